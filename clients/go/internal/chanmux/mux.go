// Package chanmux is a session's fd channel on the client's side
// (docs/protocol.md, "Requests on the channel" and "Client semantics"):
//
//   - the multiplexer (this file and requests.go): the reader goroutine
//     that owns the channel's receiving side, requests with ids of their
//     own matched to their REPLY, the stash of PAGES records that arrive
//     before their REPLY, and giving back pages nobody waits for;
//   - resume (resume.go): keeping a duplicate of every page held,
//     reconnecting after the daemon went away, ADOPT records,
//     ResumeSession (through Config.Resume), Frees deferred while the
//     daemon is away, waiting for the page requests in flight.
//
// Both share one mutex and one set of books, so they live in one package.
// The kvcached Session is a thin layer over a Mux: it turns what the Mux
// returns into the public types (Allocation, Page) and runs the gRPC calls.
package chanmux

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Config is what a Mux needs to know of its session.
type Config struct {
	ID       uint64 // the session's id (messages, ADOPT records)
	FDSocket string // the daemon's fd socket (a resume connects a new channel)
	Log      *slog.Logger
	// ResumeToken: the daemon's resume token (empty: the session is not
	// resumable; it ends when the channel hangs up). It stays the same
	// across resumes (the SessionRef's token changes).
	ResumeToken []byte
	// ResumeTimeout: how long a resume keeps trying (0: 2 minutes).
	ResumeTimeout time.Duration
	// Resume calls ResumeSession after the ADOPT records went out on the
	// new channel (whose HELLO secret is secret), claiming ids.
	Resume func(ctx context.Context, secret []byte, ids []uint64) (*pb.ResumeSessionResponse, error)
}

// Mux is one session's fd channel: requests, the reader goroutine, resume.
// It is safe for concurrent use.
type Mux struct {
	id            uint64
	fdSocket      string
	log           *slog.Logger
	resumable     bool // the daemon gave a resume token (it keeps a journal)
	resumeToken   []byte
	resumeTimeout time.Duration
	resumeCall    func(ctx context.Context, secret []byte, ids []uint64) (*pb.ResumeSessionResponse, error)

	wg         sync.WaitGroup // the reader, and a free of pages released during a resume
	readerDone chan struct{}
	stopCtx    context.Context // ends at Stop: interrupts a resume
	stop       context.CancelFunc

	mu       sync.Mutex
	pageOps  int            // Allocate/Free calls in progress (resume waits for them to settle)
	opsIdle  *sync.Cond     // on mu: pageOps reached 0 (made on first use)
	ref      *pb.SessionRef // changes (new token) at each resume
	ch       *fdchan.Conn   // changes at each resume
	allocs   map[allocKey]*pendingAlloc
	inflight int
	reqSeq   uint64             // the last request id
	waiters  map[uint64]*waiter // request id -> the call waiting for its REPLY
	endErr   error              // why the fd channel ended (set before readerDone closes)
	closed   bool

	// Resume state (resume.go); only used when resumable.
	keep      map[uint64]kept   // page id -> dup of its fd, for ADOPT
	keepSeq   uint64            // numbers kept entries (page ids are lent again)
	deferred  map[uint64]uint64 // page id -> kept seq: Free failed with Unavailable
	gen       uint64            // fd channel generation: +1 per resume
	lost      chan struct{}     // closed when the current fd channel hangs up
	resuming  bool
	resumed   chan struct{} // closed whenever not resuming
	resumes   uint64
	resumeErr error // the resume was refused or timed out: the session is dead
}

// allocKey names a pending allocation: allocation ids start again at a
// restarted daemon, so they are qualified by the fd channel generation.
type allocKey struct{ gen, id uint64 }

type pendingAlloc struct {
	total    int
	ids      []uint64
	fds      []int
	received int
	claimed  bool
	replied  bool          // an ALLOCATE request's REPLY came
	done     chan struct{} // closed when received == total
}

// New starts the multiplexer of a session bound to ch (HELLO read) with
// reference ref: its reader goroutine runs until the session ends.
func New(ch *fdchan.Conn, ref *pb.SessionRef, cfg Config) *Mux {
	m := &Mux{
		id: cfg.ID, fdSocket: cfg.FDSocket, log: cfg.Log, resumable: len(cfg.ResumeToken) > 0,
		resumeToken: cfg.ResumeToken, resumeTimeout: cfg.ResumeTimeout, resumeCall: cfg.Resume,
		ref: ref, ch: ch,
		readerDone: make(chan struct{}),
		allocs:     map[allocKey]*pendingAlloc{},
		waiters:    map[uint64]*waiter{},
		keep:       map[uint64]kept{},
		deferred:   map[uint64]uint64{},
		lost:       make(chan struct{}),
		resumed:    make(chan struct{}),
	}
	close(m.resumed)
	if m.log == nil {
		m.log = slog.New(slog.DiscardHandler)
	}
	if m.resumeTimeout <= 0 {
		m.resumeTimeout = 2 * time.Minute
	}
	m.stopCtx, m.stop = context.WithCancel(context.Background())
	m.wg.Add(1)
	go m.readLoop(ch)
	return m
}

// ReadHello reads the daemon's first record on a new channel.
func ReadHello(ctx context.Context, ch *fdchan.Conn) (fdchan.Hello, error) {
	type result struct {
		r   fdchan.Record
		err error
	}
	got := make(chan result, 1)
	go func() {
		r, err := ch.Recv()
		got <- result{r, err}
	}()
	var res result
	select {
	case res = <-got:
	case <-ctx.Done():
		ch.Close() // unblocks Recv
		<-got
		return fdchan.Hello{}, errs.FromStatus("OpenSession", ctx.Err())
	}
	switch r := res.r.(type) {
	case fdchan.Hello:
		return r, nil
	case fdchan.Error:
		return fdchan.Hello{}, errs.FromStatus("fd channel", status.Error(codes.Code(r.Code), r.Message))
	case nil:
		if errors.Is(res.err, fdchan.ErrProtocol) {
			return fdchan.Hello{}, errs.New(errs.ErrProtocol, "OpenSession", "%v", res.err)
		}
		return fdchan.Hello{}, errs.New(errs.ErrUnavailable, "OpenSession", "fd channel closed before HELLO: %v", res.err)
	default:
		return fdchan.Hello{}, errs.New(errs.ErrProtocol, "OpenSession", "first record is %T, not HELLO", r)
	}
}

// Done is closed when the session has ended (closed, or the daemon ended it).
func (m *Mux) Done() <-chan struct{} { return m.readerDone }

// Err is why the session ended (nil while it is open).
func (m *Mux) Err() error {
	select {
	case <-m.readerDone:
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.endErr
	default:
		return nil
	}
}

// MarkClosed marks the session closed by its owner (Session.Close): page
// requests fail with ErrClosed from now on (the CLOSE request excepted),
// pages nobody waits for are not given back one by one (closing returns
// them all). It returns false when the session was closed already.
func (m *Mux) MarkClosed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.closed = true
	return true
}

// ClosedErr is the error of an operation on a session that is closed or
// has ended, or nil while it is open.
func (m *Mux) ClosedErr(op string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed || m.endErr != nil {
		return m.closedErrLocked(op)
	}
	return nil
}

// Stop interrupts a resume in progress (for good: the session is closing).
func (m *Mux) Stop() { m.stop() }

// Shutdown closes the current channel and waits for the Mux's goroutines.
func (m *Mux) Shutdown() {
	m.stop()
	m.mu.Lock()
	ch := m.ch
	m.mu.Unlock()
	ch.Close()
	m.wg.Wait()
}

// readLoop owns the fd channel's receiving side. When a resumable
// session's channel hangs up (the daemon died) it resumes the session
// (resume.go) and goes on reading the new channel.
func (m *Mux) readLoop(ch *fdchan.Conn) {
	defer m.wg.Done()
	for {
		end, hangup := m.readChannel(ch)
		if hangup && m.resumable {
			next, err := m.resume(ch, end)
			if next != nil {
				ch = next
				continue
			}
			if err != nil {
				end = err
			}
		}
		m.finish(ch, end)
		return
	}
}

// readChannel reads records until the channel ends; hangup reports an end
// of stream or a read error rather than a record that ended the session.
func (m *Mux) readChannel(ch *fdchan.Conn) (end error, hangup bool) {
	for end == nil {
		r, err := ch.Recv()
		switch r := r.(type) {
		case fdchan.Pages:
			end = m.deliver(r)
		case fdchan.Reply:
			m.replied(r)
		case fdchan.Error:
			end = errs.FromStatus("fd channel", status.Error(codes.Code(r.Code), r.Message))
		case fdchan.Goodbye:
			end = errs.Ended("fd channel", "session %d ended: the daemon ended it (GOODBYE: CloseSession or shutdown)", m.id)
		case fdchan.Hello:
			end = errs.New(errs.ErrProtocol, "fd channel", "second HELLO on one channel")
		case nil:
			m.mu.Lock()
			ended := m.endErr // a protocol error found by a caller, which closed the channel
			m.mu.Unlock()
			switch {
			case ended != nil:
				end = ended
			case errors.Is(err, fdchan.ErrProtocol):
				end = errs.New(errs.ErrProtocol, "fd channel", "%v", err)
			case !m.resumable:
				end, hangup = errs.Ended("fd channel", "session %d ended: the daemon went away, and without a state dir "+
					"(kvcached-serve --state-dir) a daemon that restarts cannot resume it; open a new session (%v)", m.id, err), true
			default:
				end, hangup = errs.New(errs.ErrUnavailable, "fd channel", "the daemon closed the fd channel: %v", err), true
			}
		default:
			end = errs.New(errs.ErrProtocol, "fd channel", "unexpected record %T", r)
		}
	}
	return end, hangup
}

// finish ends the session for good: pending allocations and kept page
// descriptors are closed, Done is closed.
func (m *Mux) finish(ch *fdchan.Conn, end error) {
	m.mu.Lock()
	closing := m.closed
	if m.endErr == nil {
		m.endErr = end
	}
	for k, pa := range m.allocs {
		for _, fd := range pa.fds {
			closeFD(fd)
		}
		delete(m.allocs, k)
	}
	for id, k := range m.keep {
		closeFD(k.fd)
		delete(m.keep, id)
	}
	clear(m.waiters)
	if m.resuming {
		m.resuming = false
		close(m.resumed)
	}
	logged := m.resumeErr != nil // resumeFailed said why
	m.mu.Unlock()
	if !closing && !logged {
		m.log.Warn("kvcached session ended by the daemon", "err", end)
	}
	ch.Close()
	close(m.readerDone)
}

// deliver stashes a PAGES record's pages with their allocation (the
// stash: they arrive before the REPLY of their ALLOCATE).
func (m *Mux) deliver(r fdchan.Pages) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	key := allocKey{m.gen, r.AllocationID}
	pa := m.allocs[key]
	if pa == nil {
		pa = &pendingAlloc{done: make(chan struct{})}
		m.allocs[key] = pa
	}
	if pa.total == 0 {
		pa.total = int(r.Total)
		pa.ids = make([]uint64, pa.total)
		pa.fds = make([]int, pa.total)
		for i := range pa.fds {
			pa.fds[i] = -1
		}
	}
	if int(r.Total) != pa.total || int(r.FirstIndex)+len(r.FDs) > pa.total {
		fdchan.CloseFDs(r.FDs)
		return errs.New(errs.ErrProtocol, "fd channel", "allocation %d: record %d+%d of %d does not fit", r.AllocationID, r.FirstIndex, len(r.FDs), r.Total)
	}
	for i, fd := range r.FDs {
		j := int(r.FirstIndex) + i
		if pa.fds[j] >= 0 {
			fdchan.CloseFDs(r.FDs[i:])
			return errs.New(errs.ErrProtocol, "fd channel", "allocation %d: page index %d sent twice", r.AllocationID, j)
		}
		pa.ids[j], pa.fds[j] = r.PageIDs[i], fd
		pa.received++
		m.keepLocked(r.PageIDs[i], fd)
	}
	if pa.received == pa.total {
		close(pa.done)
		// Pages nobody waits for are given back as soon as they are
		// complete (the stash rule).
		if !pa.claimed {
			m.dropOrphanLocked(key, pa)
		}
	}
	return nil
}

// dropOrphanLocked gives back an allocation whose Allocate call failed on
// this side (its context ended) after the daemon had already sent it.
func (m *Mux) dropOrphanLocked(key allocKey, pa *pendingAlloc) {
	id := key.id
	delete(m.allocs, key)
	for _, fd := range pa.fds {
		closeFD(fd)
	}
	if m.closed {
		return
	}
	ids := pa.ids
	m.log.Info("kvcached: freeing pages of an allocation nobody waits for", "allocation_id", id, "pages", len(ids))
	m.giveBackLocked(ids)
}

// giveBackLocked sends FREE records for pages nobody waits for, at once
// and without waiting for their REPLY (which forgets the pages' kept
// descriptors when it comes). It runs under m.mu, on the reader goroutine
// or a caller's: the send is bounded by one second. While the session is
// resuming the pages are simply not claimed, which frees them.
func (m *Mux) giveBackLocked(ids []uint64) {
	if m.ch == nil || m.resuming || m.endErr != nil || m.resumeErr != nil {
		m.deferLocked(ids)
		return
	}
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		chunk := ids[i:min(i+fdchan.MaxFreeIDs, len(ids))]
		seqs := make(map[uint64]uint64, len(chunk))
		for _, id := range chunk {
			if k, ok := m.keep[id]; ok {
				seqs[id] = k.seq
			}
		}
		m.reqSeq++
		req := m.reqSeq
		m.waiters[req] = &waiter{gen: m.gen, done: make(chan struct{}), late: func(r fdchan.Reply) {
			if r.Code == 0 {
				m.unkeepSeqsLocked(seqs)
			} else {
				m.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "code", r.Code, "message", r.Message)
			}
		}}
		if err := m.ch.Send(fdchan.FreeReq{ReqID: req, PageIDs: chunk}, nil, time.Now().Add(time.Second)); err != nil {
			delete(m.waiters, req)
			m.deferLocked(chunk)
			m.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "err", err)
		}
	}
}

// deferLocked: pages the session gave up while it could not tell the
// daemon; the next resume does not claim them.
func (m *Mux) deferLocked(ids []uint64) {
	for _, id := range ids {
		if k, ok := m.keep[id]; ok {
			m.deferred[id] = k.seq
		}
	}
}

func (m *Mux) closedErrLocked(op string) error {
	if m.closed {
		return errs.New(errs.ErrClosed, op, "session %d is closed", m.id)
	}
	if m.endErr != nil {
		return m.endErr
	}
	return errs.New(errs.ErrClosed, op, "session %d ended", m.id)
}

func closeFD(fd int) {
	if fd >= 0 {
		fdchan.CloseFDs([]int{fd})
	}
}

// Pending counts the allocations stashed and the requests waiting for
// their REPLY (tests: nothing left behind).
func (m *Mux) Pending() (allocs, waiters int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.allocs), len(m.waiters)
}
