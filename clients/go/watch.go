package kvcached

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// A session's events: the Watch stream (gRPC) and the goroutine that runs
// it for WithReclaimHandler / WithEventHandler, restarting it after a
// resume.

// Reclaim is the daemon asking a session to give pages back (issue 4):
// at least Pages pages of Device, by Free, before Deadline. Reason is
// "allocate" (another session is waiting), "idle" or "admin".
type Reclaim struct {
	// ID names the request (unique for the daemon's life; 0 from a daemon
	// before the reclaim answer): Session.AnswerReclaim answers it.
	ID       uint64
	Device   string
	Pages    uint64
	Deadline time.Time
	Reason   string
}

// ReclaimHandler is called (one call at a time, on the session's watch
// goroutine) for every reclaim request. ctx ends at the deadline or when
// the session closes. The handler gives pages back with
// Region.ReleasePages (standby pages first), Region.Unmap / Region.Trim
// (or Session.Free); what it cannot give back it simply keeps
// (the daemon cannot take mapped pages by force, it reports the session).
type ReclaimHandler func(ctx context.Context, r Reclaim)

// EventKind is the kind of a Watch event.
type EventKind int

// Event kinds, as in kvcached.v1.WatchEvent.Kind.
const (
	EventUnknown EventKind = iota
	EventReady
	EventReclaim
	EventBudgetChanged
	EventMemoryAvailable
	EventShutdown
)

func (k EventKind) String() string {
	switch k {
	case EventReady:
		return "ready"
	case EventReclaim:
		return "reclaim"
	case EventBudgetChanged:
		return "budget_changed"
	case EventMemoryAvailable:
		return "memory_available"
	case EventShutdown:
		return "shutdown"
	}
	return "unknown"
}

// Event is one event of a session's Watch stream. Exactly the field that
// matches Kind is set.
type Event struct {
	Kind      EventKind
	Time      time.Time
	Reclaim   *Reclaim
	Budget    *BudgetChange
	Available *MemoryAvailable
	Shutdown  *Shutdown
}

// BudgetChange: the session's limits or a device budget changed.
type BudgetChange struct {
	Device          string
	BudgetBytes     uint64
	GuaranteedBytes uint64
	MaxBytes        uint64
	Priority        int32
}

// MemoryAvailable: pages became available on a device.
type MemoryAvailable struct {
	Device string
	Pages  uint64
}

// Shutdown: the daemon is going away; sessions close after Grace.
type Shutdown struct {
	Reason string
	Grace  time.Duration
}

func eventFromPB(e *pb.WatchEvent) Event {
	ev := Event{Kind: EventKind(e.GetKind()), Time: unixTime(e.GetTimeUnix())}
	if ev.Kind > EventShutdown || ev.Kind < 0 {
		ev.Kind = EventUnknown
	}
	switch ev.Kind {
	case EventReclaim:
		r := e.GetReclaim()
		ev.Reclaim = &Reclaim{ID: r.GetId(), Device: r.GetDevice(), Pages: r.GetPages(), Deadline: unixTime(r.GetDeadlineUnix()), Reason: r.GetReason()}
	case EventBudgetChanged:
		b := e.GetBudget()
		ev.Budget = &BudgetChange{Device: b.GetDevice(), BudgetBytes: b.GetBudgetBytes(), GuaranteedBytes: b.GetGuaranteedBytes(),
			MaxBytes: b.GetMaxBytes(), Priority: b.GetPriority()}
	case EventMemoryAvailable:
		a := e.GetAvailable()
		ev.Available = &MemoryAvailable{Device: a.GetDevice(), Pages: a.GetPages()}
	case EventShutdown:
		s := e.GetShutdown()
		ev.Shutdown = &Shutdown{Reason: s.GetReason(), Grace: time.Duration(s.GetGraceSeconds() * float64(time.Second))}
	}
	return ev
}

// Watch streams the session's events to fn until ctx ends (returns nil) or
// the stream fails (returns the error; ErrClosed-like errors when the
// session ended). The first event is always EventReady. Sessions opened
// with WithReclaimHandler already run a Watch of their own.
func (s *Session) Watch(ctx context.Context, fn func(Event)) error {
	ref, gen, err := s.m.Call("Watch")
	if err != nil {
		return err
	}
	failed := func(err error) error {
		if ctx.Err() != nil {
			return nil
		}
		return s.m.RPCErr("Watch", gen, err)
	}
	stream, err := s.c.rpc.Watch(ctx, &pb.WatchRequest{Session: ref})
	if err != nil {
		return failed(err)
	}
	for {
		e, err := stream.Recv()
		if err != nil {
			if err == io.EOF {
				return newError(ErrClosed, "Watch", "the daemon ended the watch stream")
			}
			return failed(err)
		}
		fn(eventFromPB(e))
	}
}

// watcher is the goroutine of a session opened with WithReclaimHandler or
// WithEventHandler: it runs the session's Watch stream and calls the
// handlers, restarting the stream after an interruption or a resume.
type watcher struct {
	s         *Session
	onEvent   func(Event)
	onReclaim ReclaimHandler
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// startWatcher starts the watcher of s; ready is closed at the stream's
// first event (EventReady), or when the watcher gave up.
func startWatcher(s *Session, onEvent func(Event), onReclaim ReclaimHandler) (w *watcher, ready <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	w = &watcher{s: s, onEvent: onEvent, onReclaim: onReclaim, cancel: cancel}
	r := make(chan struct{})
	w.wg.Add(1)
	go w.loop(ctx, r)
	return w, r
}

// stop ends the watcher's stream (Session.Close); nil: no watcher.
func (w *watcher) stop() {
	if w != nil {
		w.cancel()
	}
}

// wait returns when the watcher's goroutine has returned; nil: no watcher.
func (w *watcher) wait() {
	if w != nil {
		w.wg.Wait()
	}
}

func (w *watcher) loop(ctx context.Context, ready chan struct{}) {
	defer w.wg.Done()
	s := w.s
	signalled := false
	signal := func() {
		if !signalled {
			signalled = true
			close(ready)
		}
	}
	defer signal()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := s.Watch(ctx, func(ev Event) {
			backoff = 100 * time.Millisecond
			if ev.Kind == EventReady {
				signal()
			}
			if w.onEvent != nil {
				w.onEvent(ev)
			}
			if ev.Kind == EventReclaim && w.onReclaim != nil {
				s.log.Info("kvcached reclaim request", "device", ev.Reclaim.Device, "pages", ev.Reclaim.Pages,
					"reason", ev.Reclaim.Reason, "deadline", ev.Reclaim.Deadline)
				rctx, cancel := context.WithDeadline(ctx, ev.Reclaim.Deadline)
				if ev.Reclaim.Deadline.IsZero() {
					rctx, cancel = context.WithCancel(ctx)
				}
				w.onReclaim(rctx, *ev.Reclaim)
				cancel()
			}
		})
		if ctx.Err() != nil {
			return
		}
		select {
		case <-s.m.Done():
			return
		default:
		}
		if s.m.Resumable() && errors.Is(err, ErrUnavailable) {
			// The daemon went away: wait until the session is resumed (or
			// the fd channel's hang-up is noticed, then resumed), then
			// watch again with the new session token.
			if s.m.Resuming() {
				if s.WaitResumed(ctx) != nil {
					return
				}
				backoff = 100 * time.Millisecond
				continue
			}
		}
		if errorsIsAny(err, ErrFailedPrecondition, ErrNotFound, ErrPermissionDenied, ErrInvalidArgument) ||
			status.Code(err) == codes.Unimplemented {
			s.log.Error("kvcached watch stream ended", "err", err)
			return
		}
		s.log.Warn("kvcached watch stream interrupted; retrying", "err", err, "backoff", backoff)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return
		case <-s.m.Done():
			return
		}
		if backoff < 2*time.Second {
			backoff *= 2
		}
	}
}
