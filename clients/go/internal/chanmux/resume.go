package chanmux

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

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
		return nil, m.gen, awayErr(m.id, op, "")
	}
	return m.ref, m.gen, nil
}

// awayErr is the error of a call of session id made while the daemon is
// away.
func awayErr(id uint64, op, format string, a ...any) error {
	msg := fmt.Sprintf("the daemon is unreachable; session %d resumes when it is back and the pages you hold stay usable", id)
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
		return awayErr(m.id, op, "%s", ke.Message)
	case gen != m.gen && errs.IsAny(e, errs.ErrPermissionDenied, errs.ErrFailedPrecondition, errs.ErrNotFound):
		return awayErr(m.id, op, "the session was resumed during the call; try again")
	}
	return e
}

// Kept is how many page descriptors the session keeps for a resume.
func (m *Mux) Kept() int { return m.keep.count() }

// KeptState describes the kept and deferred pages (test diagnostics).
func (m *Mux) KeptState() string { return m.keep.String() }

// resumer is the resume loop, run by the reader goroutine after a
// resumable session's fd channel hung up: it reconnects with backoff,
// re-sends the pages held as ADOPT records (the keeper has their
// descriptors) and calls ResumeSession. What it changes when it is done
// (the channel, the reference, the generation) is the Mux's channel state.
type resumer struct {
	m        *Mux
	fdSocket string // the daemon's fd socket (a resume connects a new channel)
	timeout  time.Duration
	call     func(ctx context.Context, secret []byte, ids []uint64) (*pb.ResumeSessionResponse, error)
	stopCtx  context.Context // ends at Stop: interrupts a resume
	stop     context.CancelFunc
}

func newResumer(m *Mux, cfg Config) *resumer {
	r := &resumer{m: m, fdSocket: cfg.FDSocket, timeout: cfg.ResumeTimeout, call: cfg.Resume}
	if r.timeout <= 0 {
		r.timeout = 2 * time.Minute
	}
	r.stopCtx, r.stop = context.WithCancel(context.Background())
	return r
}

// run resumes the session after the fd channel old hung up. It returns
// the new channel, or nil and why the session ended (nil error when it
// was closed meanwhile).
func (r *resumer) run(old *fdchan.Conn, cause error) (*fdchan.Conn, error) {
	m := r.m
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
	m.reqs.dropUndelivered(m.keep)
	next := m.gen + 1 // the new channel's generation
	m.mu.Unlock()
	// Kept handles go before anything is claimed: a restarted daemon
	// never saw the FREEs that kept them, and its page ids are no promise
	// about the old daemon's pages. Pages of the old channel still being
	// mapped are neither kept nor mapped from a handle (generation).
	m.handles.Reset(next, false)
	held := m.keep.count()
	old.Close()
	// Before it claims anything, the resume waits for the page requests in
	// flight to settle (docs/protocol.md, "Hang-up and resume"): each wakes
	// at once (the channel is lost), and a Free among them defers its pages
	// so that they are not claimed.
	m.ops.waitIdle()
	m.log.Warn("kvcached: the daemon went away; resuming the session", "pages_held", held, "cause", cause)

	start := time.Now()
	delay := resumeFirstDelay
	attempts := 0
	for {
		attempts++
		ch, resp, claimed, err := r.once()
		if err == nil {
			return r.finish(ch, resp, claimed, attempts, time.Since(start))
		}
		if r.stopCtx.Err() != nil {
			return nil, nil
		}
		if !errors.Is(err, errs.ErrUnavailable) && !errors.Is(err, errs.ErrDeadlineExceeded) {
			return nil, r.failed(errs.New(errs.ErrFailedPrecondition, "ResumeSession",
				"session %d could not be resumed after the daemon restarted: %v", m.id, err))
		}
		if time.Since(start) > r.timeout {
			return nil, r.failed(errs.New(errs.ErrUnavailable, "ResumeSession",
				"session %d: the daemon did not come back within %v (%v)", m.id, r.timeout, err))
		}
		m.log.Debug("kvcached: resume attempt failed; retrying", "err", err, "backoff", delay)
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-r.stopCtx.Done():
			t.Stop()
			return nil, nil
		}
		delay = min(2*delay, resumeMaxDelay)
	}
}

// once is one attempt: new fd channel, HELLO, ADOPT records for the pages
// held, ResumeSession.
func (r *resumer) once() (*fdchan.Conn, *pb.ResumeSessionResponse, []uint64, error) {
	m := r.m
	ctx, cancel := context.WithTimeout(r.stopCtx, resumeAttempt)
	defer cancel()
	ch, err := fdchan.Dial(r.fdSocket)
	if err != nil {
		return nil, nil, nil, errs.New(errs.ErrUnavailable, "ResumeSession", "connecting the fd channel %s: %v", r.fdSocket, err)
	}
	hello, err := ReadHello(ctx, ch)
	if err != nil {
		ch.Close()
		if !errors.Is(err, errs.ErrProtocol) {
			err = errs.New(errs.ErrUnavailable, "ResumeSession", "%v", err)
		}
		return nil, nil, nil, err
	}
	// Pages whose Free failed while the daemon was away are not claimed.
	deadline, _ := ctx.Deadline()
	ids, err := m.keep.adopt(func(ids []uint64, fds []int) error {
		return ch.SendAdopt(m.id, ids, fds, deadline)
	})
	if err != nil {
		ch.Close()
		return nil, nil, nil, errs.New(errs.ErrUnavailable, "ResumeSession", "sending ADOPT records: %v", err)
	}
	resp, err := r.call(ctx, hello.Secret[:], ids)
	if err != nil {
		ch.Close()
		return nil, nil, nil, errs.FromStatus("ResumeSession", err)
	}
	return ch, resp, ids, nil
}

// finish swaps in the new channel and reference after a successful
// ResumeSession.
func (r *resumer) finish(ch *fdchan.Conn, resp *pb.ResumeSessionResponse, claimed []uint64, attempts int, took time.Duration) (*fdchan.Conn, error) {
	m := r.m
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		ch.Close() // the daemon ends the session when its channel closes
		return nil, nil
	}
	// Pages freed (and failed with UNAVAILABLE) while this attempt was in
	// flight were claimed: give them back now.
	late := m.keep.deferredAmong(claimed)
	m.ch = ch
	m.ref = resp.GetSession()
	m.gen++
	m.reqs.dropStale(m.gen, m.endErr != nil)
	m.lost = make(chan struct{})
	m.resumes++
	m.resuming = false
	close(m.resumed)
	m.mu.Unlock()
	m.log.Warn("kvcached session resumed", "pages_adopted", resp.GetPagesAdopted(),
		"pages_forgotten", resp.GetPagesForgotten(), "attempts", attempts, "took", took)
	// Standby pages the restarted daemon adopted: it counts them in use (it
	// does not journal standby), so they are said again.
	standby := m.standbyAmong(claimed, late)
	if len(late) > 0 || len(standby) > 0 {
		// Over the new channel, whose REPLY this (reader) goroutine reads:
		// from another goroutine.
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			ctx, cancel := context.WithTimeout(r.stopCtx, resumeAttempt)
			defer cancel()
			if len(late) > 0 {
				if _, err := m.Free(ctx, late); err != nil {
					m.log.Warn("kvcached: freeing pages released during the resume failed", "pages", len(late), "err", err)
				}
			}
			// not taken back meanwhile (Use ends it)
			if again := m.standbyAmong(standby, nil); len(again) > 0 {
				if _, err := m.Standby(ctx, again); err != nil {
					// they stay in use in the books: right, only not asked for first by a reclaim
					m.log.Warn("kvcached: keeping pages as standby again after the resume failed", "pages", len(again), "err", err)
				}
			}
		}()
	}
	return ch, nil
}

// failed makes the session dead: calls return err from now on.
func (r *resumer) failed(err error) error {
	m := r.m
	m.mu.Lock()
	m.resumeErr = err
	m.mu.Unlock()
	m.log.Error("kvcached session could not be resumed", "err", err)
	return err
}

// pageOps counts the Allocate calls and FREE requests in progress, so that
// a resume can wait for them to settle.
type pageOps struct {
	mu   sync.Mutex
	n    int
	idle *sync.Cond // on mu: n reached 0 (made on first use)
}

func (p *pageOps) begin() {
	p.mu.Lock()
	p.n++
	p.mu.Unlock()
}

func (p *pageOps) end() {
	p.mu.Lock()
	p.n--
	if p.n == 0 && p.idle != nil {
		p.idle.Broadcast()
	}
	p.mu.Unlock()
}

// waitIdle returns when no page request is in progress.
func (p *pageOps) waitIdle() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.n > 0 {
		if p.idle == nil {
			p.idle = sync.NewCond(&p.mu)
		}
		p.idle.Wait()
	}
}
