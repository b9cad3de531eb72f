// Package chanmux is a session's fd channel on the client's side
// (docs/protocol.md, "Requests on the channel" and "Client semantics").
// A Mux (this file) coordinates its parts, each with its own state:
//
//   - requests (requests.go, table.go): requests with ids of their own
//     matched to their REPLY, the stash of PAGES records that arrive
//     before their REPLY, and giving back pages nobody waits for;
//   - the reader (reader.go): the goroutine that owns the channel's
//     receiving side and dispatches its records;
//   - resume (resume.go, keeper.go): keeping a duplicate of every page
//     held, reconnecting after the daemon went away, ADOPT records,
//     ResumeSession (through Config.Resume), Frees deferred while the
//     daemon is away, waiting for the page requests in flight.
//
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
	// Handles is the session's cache of kept handles (handles.go); nil:
	// the session keeps none (its FREEs never carry keep; a DROP is
	// answered all the same).
	Handles Handles
}

// Mux is one session's fd channel: requests, the reader goroutine, resume.
// It is safe for concurrent use. It coordinates parts that each own their
// state: the table of requests (table.go), the keeper of page descriptors
// for a resume (keeper.go), the reader goroutine (reader.go) and the
// resume loop (resume.go). The Mux itself holds the channel state: which
// channel and session reference are current, their generation, whether
// the session is closed, resuming or ended.
type Mux struct {
	id        uint64
	log       *slog.Logger
	resumable bool // the daemon gave a resume token (it keeps a journal)

	reqs *table   // requests waiting for their REPLY, the stash of pages
	keep *keeper  // page descriptors kept for a resume, deferred Frees
	ops  pageOps  // Allocate and FREE requests in progress
	rd   *reader  // the reader goroutine
	res  *resumer // the resume loop (run by the reader)

	handles Handles // kept handles of pages (handles.go)

	wg sync.WaitGroup // the reader, and a free of pages released during a resume

	// mu guards the channel state. It is taken before the table's lock and
	// the keeper's: the table's entries belong to a channel generation.
	mu        sync.Mutex
	ref       *pb.SessionRef // changes (new token) at each resume
	ch        *fdchan.Conn   // changes at each resume
	gen       uint64         // fd channel generation: +1 per resume
	lost      chan struct{}  // closed when the current fd channel hangs up
	endErr    error          // why the fd channel ended (set before the reader's done closes)
	closed    bool
	resuming  bool
	resumed   chan struct{} // closed whenever not resuming
	resumes   uint64
	resumeErr error // the resume was refused or timed out: the session is dead
	// standby: held pages kept as standby (Standby adds, Use and Free end
	// it), said again to a restarted daemon, which does not journal standby.
	standby map[uint64]struct{}
}

// New starts the multiplexer of a session bound to ch (HELLO read) with
// reference ref: its reader goroutine runs until the session ends.
func New(ch *fdchan.Conn, ref *pb.SessionRef, cfg Config) *Mux {
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	resumable := len(cfg.ResumeToken) > 0
	m := &Mux{
		id: cfg.ID, log: log, resumable: resumable,
		reqs: newTable(), keep: newKeeper(resumable, log),
		ref: ref, ch: ch,
		lost:    make(chan struct{}),
		resumed: make(chan struct{}),
		standby: map[uint64]struct{}{},
	}
	close(m.resumed)
	m.handles = cfg.Handles
	if m.handles == nil {
		m.handles = noHandles{}
	}
	m.res = newResumer(m, cfg)
	m.rd = &reader{m: m, done: make(chan struct{})}
	m.wg.Add(1)
	go m.rd.loop(ch)
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
func (m *Mux) Done() <-chan struct{} { return m.rd.done }

// Err is why the session ended (nil while it is open).
func (m *Mux) Err() error {
	select {
	case <-m.rd.done:
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
func (m *Mux) Stop() { m.res.stop() }

// Shutdown closes the current channel and waits for the Mux's goroutines.
func (m *Mux) Shutdown() {
	m.res.stop()
	m.mu.Lock()
	ch := m.ch
	m.mu.Unlock()
	ch.Close()
	m.wg.Wait()
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
func (m *Mux) Pending() (allocs, waiters int) { return m.reqs.counts() }
