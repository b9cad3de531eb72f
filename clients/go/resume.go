package kvcached

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Resume after a daemon restart (docs/reliability.md, "Daemon restart with
// clients alive"). A daemon started with --state-dir answers OpenSession
// with a resume token. The session then keeps a duplicate descriptor of
// every page it holds; when its fd channel hangs up (the daemon died) the
// reader goroutine reconnects with backoff, re-sends the pages as ADOPT
// records on a new fd channel and calls ResumeSession. Mapped pages never
// move: Regions and Allocations stay usable throughout.

const (
	resumeFirstDelay = 50 * time.Millisecond
	resumeMaxDelay   = time.Second
	resumeAttempt    = 10 * time.Second // one attempt: HELLO, ADOPT, ResumeSession
)

// Resumable reports whether the session survives a daemon restart (the
// daemon keeps a journal: kvcached-serve --state-dir).
func (s *Session) Resumable() bool { return s.resumable }

// Resumes is how many times the session was resumed after a daemon restart.
func (s *Session) Resumes() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resumes
}

// WaitResumed blocks while the session is being resumed after the daemon
// went away. It returns nil when the session is usable (at once if it is
// not resuming), the reason the session ended (ErrFailedPrecondition when
// the restarted daemon refused the resume, ErrUnavailable when it did not
// come back in time, ErrClosed after Close), or ctx's error.
func (s *Session) WaitResumed(ctx context.Context) error {
	s.mu.Lock()
	resumed := s.resumed
	s.mu.Unlock()
	select {
	case <-resumed:
	case <-ctx.Done():
		return statusToError("WaitResumed", ctx.Err())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resumeErr != nil {
		return s.resumeErr
	}
	if s.closed || s.endErr != nil {
		return s.closedErrLocked("WaitResumed")
	}
	return nil
}

func (s *Session) resumingNow() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.resuming
}

// call returns the session reference to send and its generation, or the
// generation and the error to return without calling the daemon
// (resuming, or dead after a failed resume).
func (s *Session) call(op string) (*pb.SessionRef, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resumeErr != nil {
		return nil, s.gen, s.resumeErr
	}
	if s.resuming {
		return nil, s.gen, s.unavailableLocked(op, "")
	}
	return s.ref, s.gen, nil
}

// unavailableLocked is the error of a call made while the daemon is away.
func (s *Session) unavailableLocked(op, format string, a ...any) error {
	msg := fmt.Sprintf("the daemon is unreachable; session %d resumes when it is back and the pages you hold stay usable", s.id)
	if format != "" {
		msg += " (" + fmt.Sprintf(format, a...) + ")"
	}
	return newError(ErrUnavailable, op, "%s", msg)
}

// rpcErr maps the error of a call made with the reference of generation
// gen. On a resumable session UNAVAILABLE says that the session resumes;
// a refusal of the old token by a daemon that has resumed the session in
// the meantime is UNAVAILABLE too (try again).
func (s *Session) rpcErr(op string, gen uint64, err error) error {
	e := statusToError(op, err)
	if !s.resumable {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return e
	}
	var ke *Error
	errors.As(e, &ke)
	switch {
	case errors.Is(e, ErrUnavailable):
		return s.unavailableLocked(op, "%s", ke.Message)
	case gen != s.gen && errorsIsAny(e, ErrPermissionDenied, ErrFailedPrecondition, ErrNotFound):
		return s.unavailableLocked(op, "the session was resumed during the call; try again")
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
func (s *Session) keepLocked(id uint64, fd int) {
	if !s.resumable {
		return
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		// Without the duplicate the page cannot be claimed at resume: it is
		// given back then (the mapping stays valid, as for any Free).
		s.log.Warn("kvcached: cannot keep a duplicate page descriptor for resume", "page_id", id, "err", err)
		return
	}
	if old, ok := s.keep[id]; ok {
		closeFD(old.fd)
	}
	s.keepSeq++
	s.keep[id] = kept{fd: dup, seq: s.keepSeq}
	delete(s.deferred, id)
}

// keptSeqs names the kept entries of pages about to be freed.
func (s *Session) keptSeqs(ids []uint64) map[uint64]uint64 {
	if !s.resumable {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	seqs := make(map[uint64]uint64, len(ids))
	for _, id := range ids {
		if k, ok := s.keep[id]; ok {
			seqs[id] = k.seq
		}
	}
	return seqs
}

// unkeep forgets pages the daemon has taken back (the entries named by
// keptSeqs before the Free; not a page lent again since).
func (s *Session) unkeep(seqs map[uint64]uint64) {
	if len(seqs) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unkeepSeqsLocked(seqs)
}

func (s *Session) unkeepSeqsLocked(seqs map[uint64]uint64) {
	for id, seq := range seqs {
		if k, ok := s.keep[id]; ok && k.seq == seq {
			s.unkeepLocked(id)
		}
	}
}

func (s *Session) unkeepLocked(id uint64) {
	if k, ok := s.keep[id]; ok {
		closeFD(k.fd)
		delete(s.keep, id)
	}
	delete(s.deferred, id)
}

// deferFree records pages whose Free (made with generation gen) failed
// with UNAVAILABLE: the next resume does not claim them. It returns false
// when a resume has completed since and claimed them (Free again).
func (s *Session) deferFree(gen uint64, seqs map[uint64]uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.resumeErr != nil || gen == s.gen {
		for id, seq := range seqs {
			if k, ok := s.keep[id]; ok && k.seq == seq {
				s.deferred[id] = seq
			}
		}
		return true
	}
	return false
}

// resume runs on the reader goroutine after the fd channel old hung up.
// It returns the new channel, or nil and why the session ended (nil error
// when it was closed meanwhile).
func (s *Session) resume(old *fdchan.Conn, cause error) (*fdchan.Conn, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, nil
	}
	s.resuming = true
	s.resumed = make(chan struct{})
	close(s.lost)
	// Allocations not fully delivered are lost: close what arrived and do
	// not claim it (complete ones are taken by their Allocate call). So
	// are ALLOCATE requests not answered yet: their callers get
	// ErrUnavailable.
	for k, pa := range s.allocs {
		if pa.total > 0 && pa.received == pa.total && (k.id&fdchan.AllocBit == 0 || pa.replied) {
			continue
		}
		for j, fd := range pa.fds {
			if fd >= 0 {
				closeFD(fd)
				s.unkeepLocked(pa.ids[j])
			}
		}
		delete(s.allocs, k)
	}
	held := len(s.keep)
	s.mu.Unlock()
	old.Close()
	// Before it claims anything, the resume waits for the page requests in
	// flight to settle (docs/protocol.md, "Hang-up and resume"): each wakes
	// at once (the channel is lost), and a Free among them defers its pages
	// so that they are not claimed.
	s.mu.Lock()
	for s.pageOps > 0 {
		s.opsIdleLocked().Wait()
	}
	s.mu.Unlock()
	s.log.Warn("kvcached: the daemon went away; resuming the session", "pages_held", held, "cause", cause)

	start := time.Now()
	delay := resumeFirstDelay
	attempts := 0
	for {
		attempts++
		ch, resp, claimed, err := s.resumeOnce()
		if err == nil {
			return s.finishResume(ch, resp, claimed, attempts, time.Since(start))
		}
		if s.stopCtx.Err() != nil {
			return nil, nil
		}
		if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrDeadlineExceeded) {
			return nil, s.resumeFailed(newError(ErrFailedPrecondition, "ResumeSession",
				"session %d could not be resumed after the daemon restarted: %v", s.id, err))
		}
		if time.Since(start) > s.resumeTimeout {
			return nil, s.resumeFailed(newError(ErrUnavailable, "ResumeSession",
				"session %d: the daemon did not come back within %v (%v)", s.id, s.resumeTimeout, err))
		}
		s.log.Debug("kvcached: resume attempt failed; retrying", "err", err, "backoff", delay)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-s.stopCtx.Done():
			t.Stop()
			return nil, nil
		}
		delay = min(2*delay, resumeMaxDelay)
	}
}

// resumeOnce is one attempt: new fd channel, HELLO, ADOPT records for the
// pages held, ResumeSession.
func (s *Session) resumeOnce() (*fdchan.Conn, *pb.ResumeSessionResponse, []uint64, error) {
	ctx, cancel := context.WithTimeout(s.stopCtx, resumeAttempt)
	defer cancel()
	ch, err := fdchan.Dial(s.info.FDSocket)
	if err != nil {
		return nil, nil, nil, newError(ErrUnavailable, "ResumeSession", "connecting the fd channel %s: %v", s.info.FDSocket, err)
	}
	hello, err := readHello(ctx, ch)
	if err != nil {
		ch.Close()
		if !errors.Is(err, ErrProtocol) {
			err = newError(ErrUnavailable, "ResumeSession", "%v", err)
		}
		return nil, nil, nil, err
	}
	s.mu.Lock()
	// Pages whose Free failed while the daemon was away are not claimed
	// (the old daemon may or may not have freed them): the new daemon
	// forgets them, which frees them.
	for id, seq := range s.deferred {
		if k, ok := s.keep[id]; ok && k.seq == seq {
			s.unkeepLocked(id)
		}
	}
	clear(s.deferred)
	ids := make([]uint64, 0, len(s.keep))
	for id := range s.keep {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	fds := make([]int, len(ids))
	for i, id := range ids {
		fds[i] = s.keep[id].fd
	}
	// Sent under s.mu: a concurrent Free cannot close a descriptor that is
	// being sent.
	deadline, _ := ctx.Deadline()
	err = ch.SendAdopt(s.id, ids, fds, deadline)
	s.mu.Unlock()
	if err != nil {
		ch.Close()
		return nil, nil, nil, newError(ErrUnavailable, "ResumeSession", "sending ADOPT records: %v", err)
	}
	resp, err := s.c.rpc.ResumeSession(ctx, &pb.ResumeSessionRequest{
		ChannelSecret: hello.Secret[:], SessionId: s.id, ResumeToken: s.resumeToken, PageIds: ids,
	}, grpc.WaitForReady(true))
	if err != nil {
		ch.Close()
		return nil, nil, nil, statusToError("ResumeSession", err)
	}
	return ch, resp, ids, nil
}

// finishResume swaps in the new channel and reference after a successful
// ResumeSession.
func (s *Session) finishResume(ch *fdchan.Conn, resp *pb.ResumeSessionResponse, claimed []uint64, attempts int, took time.Duration) (*fdchan.Conn, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		ch.Close() // the daemon ends the session when its channel closes
		return nil, nil
	}
	// Pages freed (and failed with UNAVAILABLE) while this attempt was in
	// flight were claimed: give them back now.
	var late []uint64
	for _, id := range claimed {
		if _, ok := s.deferred[id]; ok {
			late = append(late, id)
		}
	}
	s.ch = ch
	s.ref = resp.GetSession()
	s.gen++
	s.dropWaitersLocked()
	s.lost = make(chan struct{})
	s.resumes++
	s.resuming = false
	close(s.resumed)
	s.mu.Unlock()
	s.log.Warn("kvcached session resumed", "pages_adopted", resp.GetPagesAdopted(),
		"pages_forgotten", resp.GetPagesForgotten(), "attempts", attempts, "took", took)
	if len(late) > 0 {
		// Over the new channel, whose REPLY this (reader) goroutine reads:
		// from another goroutine.
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			ctx, cancel := context.WithTimeout(s.stopCtx, resumeAttempt)
			defer cancel()
			if _, err := s.freeOnChannel(ctx, late); err != nil {
				s.log.Warn("kvcached: freeing pages released during the resume failed", "pages", len(late), "err", err)
			}
		}()
	}
	return ch, nil
}

// resumeFailed makes the session dead: calls return err from now on.
func (s *Session) resumeFailed(err error) error {
	s.mu.Lock()
	s.resumeErr = err
	s.mu.Unlock()
	s.log.Error("kvcached session could not be resumed", "err", err)
	return err
}

// pageOpBegin and pageOpEnd bracket an Allocate or one FREE record's
// request, so that a resume can wait for them to settle.
func (s *Session) pageOpBegin() {
	s.mu.Lock()
	s.pageOps++
	s.mu.Unlock()
}

func (s *Session) pageOpEnd() {
	s.mu.Lock()
	s.pageOps--
	if s.pageOps == 0 {
		s.opsIdleLocked().Broadcast()
	}
	s.mu.Unlock()
}

func (s *Session) opsIdleLocked() *sync.Cond {
	if s.opsIdle == nil {
		s.opsIdle = sync.NewCond(&s.mu)
	}
	return s.opsIdle
}
