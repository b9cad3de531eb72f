package chanmux

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Resume after a daemon restart (docs/reliability.md, "Daemon restart with
// clients alive"). A daemon started with --state-dir answers OpenSession
// with a resume token. The session then keeps a duplicate descriptor of
// every page it holds; when its fd channel hangs up (the daemon died) the
// reader goroutine reconnects with backoff, re-sends the pages as ADOPT
// records on a new fd channel and calls ResumeSession (Config.Resume).
// Mapped pages never move: Regions and Allocations stay usable throughout.

const (
	resumeFirstDelay = 50 * time.Millisecond
	resumeMaxDelay   = time.Second
	resumeAttempt    = 10 * time.Second // one attempt: HELLO, ADOPT, ResumeSession
)

// Resumable reports whether the session survives a daemon restart (the
// daemon keeps a journal: kvcached-serve --state-dir).
func (m *Mux) Resumable() bool { return m.resumable }

// Resumes is how many times the session was resumed after a daemon restart.
func (m *Mux) Resumes() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.resumes
}

// WaitResumed blocks while the session is being resumed after the daemon
// went away. It returns nil when the session is usable (at once if it is
// not resuming), the reason the session ended (ErrFailedPrecondition when
// the restarted daemon refused the resume, ErrUnavailable when it did not
// come back in time, ErrClosed after Close), or ctx's error.
func (m *Mux) WaitResumed(ctx context.Context) error {
	m.mu.Lock()
	resumed := m.resumed
	m.mu.Unlock()
	select {
	case <-resumed:
	case <-ctx.Done():
		return errs.FromStatus("WaitResumed", ctx.Err())
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.resumeErr != nil {
		return m.resumeErr
	}
	if m.closed || m.endErr != nil {
		return m.closedErrLocked("WaitResumed")
	}
	return nil
}

// Resuming reports whether the session is being resumed now.
func (m *Mux) Resuming() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.resuming
}

// Call returns the session reference to send and its generation, or the
// generation and the error to return without calling the daemon
// (resuming, or dead after a failed resume).
func (m *Mux) Call(op string) (*pb.SessionRef, uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.resumeErr != nil {
		return nil, m.gen, m.resumeErr
	}
	if m.resuming {
		return nil, m.gen, m.unavailableLocked(op, "")
	}
	return m.ref, m.gen, nil
}

// unavailableLocked is the error of a call made while the daemon is away.
func (m *Mux) unavailableLocked(op, format string, a ...any) error {
	msg := fmt.Sprintf("the daemon is unreachable; session %d resumes when it is back and the pages you hold stay usable", m.id)
	if format != "" {
		msg += " (" + fmt.Sprintf(format, a...) + ")"
	}
	return errs.New(errs.ErrUnavailable, op, "%s", msg)
}

// RPCErr maps the error of a call made with the reference of generation
// gen. On a resumable session UNAVAILABLE says that the session resumes;
// a refusal of the old token by a daemon that has resumed the session in
// the meantime is UNAVAILABLE too (try again).
func (m *Mux) RPCErr(op string, gen uint64, err error) error {
	e := errs.FromStatus(op, err)
	if !m.resumable {
		return e
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return e
	}
	var ke *errs.Error
	errors.As(e, &ke)
	switch {
	case errors.Is(e, errs.ErrUnavailable):
		return m.unavailableLocked(op, "%s", ke.Message)
	case gen != m.gen && errs.IsAny(e, errs.ErrPermissionDenied, errs.ErrFailedPrecondition, errs.ErrNotFound):
		return m.unavailableLocked(op, "the session was resumed during the call; try again")
	}
	return e
}

// kept is the duplicate descriptor of a page the session holds. The
// daemon lends a page again under the same id after a Free, possibly to
// another goroutine of this session while the Free's answer is on its way:
// seq tells the entries of one id apart.
type kept struct {
	fd  int
	seq uint64
}

// keepLocked keeps a duplicate of a page's descriptor, to re-send it to a
// restarted daemon.
func (m *Mux) keepLocked(id uint64, fd int) {
	if !m.resumable {
		return
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		// Without the duplicate the page cannot be claimed at resume: it is
		// given back then (the mapping stays valid, as for any Free).
		m.log.Warn("kvcached: cannot keep a duplicate page descriptor for resume", "page_id", id, "err", err)
		return
	}
	if old, ok := m.keep[id]; ok {
		closeFD(old.fd)
	}
	m.keepSeq++
	m.keep[id] = kept{fd: dup, seq: m.keepSeq}
	delete(m.deferred, id)
}

// keptSeqs names the kept entries of pages about to be freed.
func (m *Mux) keptSeqs(ids []uint64) map[uint64]uint64 {
	if !m.resumable {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	seqs := make(map[uint64]uint64, len(ids))
	for _, id := range ids {
		if k, ok := m.keep[id]; ok {
			seqs[id] = k.seq
		}
	}
	return seqs
}

// unkeep forgets pages the daemon has taken back (the entries named by
// keptSeqs before the Free; not a page lent again since).
func (m *Mux) unkeep(seqs map[uint64]uint64) {
	if len(seqs) == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unkeepSeqsLocked(seqs)
}

func (m *Mux) unkeepSeqsLocked(seqs map[uint64]uint64) {
	for id, seq := range seqs {
		if k, ok := m.keep[id]; ok && k.seq == seq {
			m.unkeepLocked(id)
		}
	}
}

func (m *Mux) unkeepLocked(id uint64) {
	if k, ok := m.keep[id]; ok {
		closeFD(k.fd)
		delete(m.keep, id)
	}
	delete(m.deferred, id)
}

// deferFree records pages whose Free (made with generation gen) failed
// with UNAVAILABLE: the next resume does not claim them. It returns false
// when a resume has completed since and claimed them (Free again).
func (m *Mux) deferFree(gen uint64, seqs map[uint64]uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed || m.resumeErr != nil || gen == m.gen {
		for id, seq := range seqs {
			if k, ok := m.keep[id]; ok && k.seq == seq {
				m.deferred[id] = seq
			}
		}
		return true
	}
	return false
}

// resume runs on the reader goroutine after the fd channel old hung up.
// It returns the new channel, or nil and why the session ended (nil error
// when it was closed meanwhile).
func (m *Mux) resume(old *fdchan.Conn, cause error) (*fdchan.Conn, error) {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, nil
	}
	m.resuming = true
	m.resumed = make(chan struct{})
	close(m.lost)
	// Allocations not fully delivered are lost: close what arrived and do
	// not claim it (complete ones are taken by their Allocate call). So
	// are ALLOCATE requests not answered yet: their callers get
	// ErrUnavailable.
	for k, pa := range m.allocs {
		if pa.total > 0 && pa.received == pa.total && (k.id&fdchan.AllocBit == 0 || pa.replied) {
			continue
		}
		for j, fd := range pa.fds {
			if fd >= 0 {
				closeFD(fd)
				m.unkeepLocked(pa.ids[j])
			}
		}
		delete(m.allocs, k)
	}
	held := len(m.keep)
	m.mu.Unlock()
	old.Close()
	// Before it claims anything, the resume waits for the page requests in
	// flight to settle (docs/protocol.md, "Hang-up and resume"): each wakes
	// at once (the channel is lost), and a Free among them defers its pages
	// so that they are not claimed.
	m.mu.Lock()
	for m.pageOps > 0 {
		m.opsIdleLocked().Wait()
	}
	m.mu.Unlock()
	m.log.Warn("kvcached: the daemon went away; resuming the session", "pages_held", held, "cause", cause)

	start := time.Now()
	delay := resumeFirstDelay
	attempts := 0
	for {
		attempts++
		ch, resp, claimed, err := m.resumeOnce()
		if err == nil {
			return m.finishResume(ch, resp, claimed, attempts, time.Since(start))
		}
		if m.stopCtx.Err() != nil {
			return nil, nil
		}
		if !errors.Is(err, errs.ErrUnavailable) && !errors.Is(err, errs.ErrDeadlineExceeded) {
			return nil, m.resumeFailed(errs.New(errs.ErrFailedPrecondition, "ResumeSession",
				"session %d could not be resumed after the daemon restarted: %v", m.id, err))
		}
		if time.Since(start) > m.resumeTimeout {
			return nil, m.resumeFailed(errs.New(errs.ErrUnavailable, "ResumeSession",
				"session %d: the daemon did not come back within %v (%v)", m.id, m.resumeTimeout, err))
		}
		m.log.Debug("kvcached: resume attempt failed; retrying", "err", err, "backoff", delay)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-m.stopCtx.Done():
			t.Stop()
			return nil, nil
		}
		delay = min(2*delay, resumeMaxDelay)
	}
}

// resumeOnce is one attempt: new fd channel, HELLO, ADOPT records for the
// pages held, ResumeSession.
func (m *Mux) resumeOnce() (*fdchan.Conn, *pb.ResumeSessionResponse, []uint64, error) {
	ctx, cancel := context.WithTimeout(m.stopCtx, resumeAttempt)
	defer cancel()
	ch, err := fdchan.Dial(m.fdSocket)
	if err != nil {
		return nil, nil, nil, errs.New(errs.ErrUnavailable, "ResumeSession", "connecting the fd channel %s: %v", m.fdSocket, err)
	}
	hello, err := ReadHello(ctx, ch)
	if err != nil {
		ch.Close()
		if !errors.Is(err, errs.ErrProtocol) {
			err = errs.New(errs.ErrUnavailable, "ResumeSession", "%v", err)
		}
		return nil, nil, nil, err
	}
	m.mu.Lock()
	// Pages whose Free failed while the daemon was away are not claimed
	// (the old daemon may or may not have freed them): the new daemon
	// forgets them, which frees them.
	for id, seq := range m.deferred {
		if k, ok := m.keep[id]; ok && k.seq == seq {
			m.unkeepLocked(id)
		}
	}
	clear(m.deferred)
	ids := make([]uint64, 0, len(m.keep))
	for id := range m.keep {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	fds := make([]int, len(ids))
	for i, id := range ids {
		fds[i] = m.keep[id].fd
	}
	// Sent under m.mu: a concurrent Free cannot close a descriptor that is
	// being sent.
	deadline, _ := ctx.Deadline()
	err = ch.SendAdopt(m.id, ids, fds, deadline)
	m.mu.Unlock()
	if err != nil {
		ch.Close()
		return nil, nil, nil, errs.New(errs.ErrUnavailable, "ResumeSession", "sending ADOPT records: %v", err)
	}
	resp, err := m.resumeCall(ctx, hello.Secret[:], ids)
	if err != nil {
		ch.Close()
		return nil, nil, nil, errs.FromStatus("ResumeSession", err)
	}
	return ch, resp, ids, nil
}

// finishResume swaps in the new channel and reference after a successful
// ResumeSession.
func (m *Mux) finishResume(ch *fdchan.Conn, resp *pb.ResumeSessionResponse, claimed []uint64, attempts int, took time.Duration) (*fdchan.Conn, error) {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		ch.Close() // the daemon ends the session when its channel closes
		return nil, nil
	}
	// Pages freed (and failed with UNAVAILABLE) while this attempt was in
	// flight were claimed: give them back now.
	var late []uint64
	for _, id := range claimed {
		if _, ok := m.deferred[id]; ok {
			late = append(late, id)
		}
	}
	m.ch = ch
	m.ref = resp.GetSession()
	m.gen++
	m.dropWaitersLocked()
	m.lost = make(chan struct{})
	m.resumes++
	m.resuming = false
	close(m.resumed)
	m.mu.Unlock()
	m.log.Warn("kvcached session resumed", "pages_adopted", resp.GetPagesAdopted(),
		"pages_forgotten", resp.GetPagesForgotten(), "attempts", attempts, "took", took)
	if len(late) > 0 {
		// Over the new channel, whose REPLY this (reader) goroutine reads:
		// from another goroutine.
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			ctx, cancel := context.WithTimeout(m.stopCtx, resumeAttempt)
			defer cancel()
			if _, err := m.Free(ctx, late); err != nil {
				m.log.Warn("kvcached: freeing pages released during the resume failed", "pages", len(late), "err", err)
			}
		}()
	}
	return ch, nil
}

// resumeFailed makes the session dead: calls return err from now on.
func (m *Mux) resumeFailed(err error) error {
	m.mu.Lock()
	m.resumeErr = err
	m.mu.Unlock()
	m.log.Error("kvcached session could not be resumed", "err", err)
	return err
}

// pageOpBegin and pageOpEnd bracket an Allocate or one FREE record's
// request, so that a resume can wait for them to settle.
func (m *Mux) pageOpBegin() {
	m.mu.Lock()
	m.pageOps++
	m.mu.Unlock()
}

func (m *Mux) pageOpEnd() {
	m.mu.Lock()
	m.pageOps--
	if m.pageOps == 0 {
		m.opsIdleLocked().Broadcast()
	}
	m.mu.Unlock()
}

func (m *Mux) opsIdleLocked() *sync.Cond {
	if m.opsIdle == nil {
		m.opsIdle = sync.NewCond(&m.mu)
	}
	return m.opsIdle
}

// Kept is how many page descriptors the session keeps for a resume.
func (m *Mux) Kept() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.keep)
}

// KeptState describes the kept and deferred pages (test diagnostics).
func (m *Mux) KeptState() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return fmt.Sprintf("keep %v deferred %v", m.keep, m.deferred)
}
