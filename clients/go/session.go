package kvcached

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/chanmux"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

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
// the session closes. The handler gives pages back with Region.Unmap /
// Region.Trim (or Session.Free); what it cannot give back it simply keeps
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

// SessionOption configures OpenSession.
type SessionOption func(*sessionOptions)

type sessionOptions struct {
	guaranteed, max uint64
	priority        int32
	labels          map[string]string
	onReclaim       ReclaimHandler
	onEvent         func(Event)
	resumeTimeout   time.Duration
}

// WithGuaranteedBytes: bytes per device never reclaimed from the session.
func WithGuaranteedBytes(n uint64) SessionOption {
	return func(o *sessionOptions) { o.guaranteed = n }
}

// WithMaxBytes: the most the session may hold per device (0 = the budget).
func WithMaxBytes(n uint64) SessionOption { return func(o *sessionOptions) { o.max = n } }

// WithPriority: lower priorities are asked to give pages back first.
func WithPriority(p int32) SessionOption { return func(o *sessionOptions) { o.priority = p } }

// WithLabels adds labels (for example "model_digest": "sha256:...").
func WithLabels(labels map[string]string) SessionOption {
	return func(o *sessionOptions) {
		if o.labels == nil {
			o.labels = map[string]string{}
		}
		for k, v := range labels {
			o.labels[k] = v
		}
	}
}

// WithReclaimHandler registers the reclaim callback. The session then runs
// its Watch stream on a goroutine until Close.
func WithReclaimHandler(h ReclaimHandler) SessionOption {
	return func(o *sessionOptions) { o.onReclaim = h }
}

// WithEventHandler registers a callback for every Watch event (called
// before the reclaim handler, on the same goroutine).
func WithEventHandler(h func(Event)) SessionOption { return func(o *sessionOptions) { o.onEvent = h } }

// WithResumeTimeout bounds how long a resumable session keeps trying to
// resume after the daemon went away (default 2 minutes); after that it ends
// with ErrUnavailable.
func WithResumeTimeout(d time.Duration) SessionOption {
	return func(o *sessionOptions) { o.resumeTimeout = d }
}

// Session is one session with the daemon, bound to its own fd channel. It
// is safe for concurrent use. It is a thin layer: the fd channel (requests,
// the reader goroutine, the stash of pages, resume) is its chanmux.Mux;
// the Session turns what the Mux returns into this package's types, runs
// the gRPC calls (admin.go, Watch) and owns the regions and mappers.
type Session struct {
	c     *Client
	id    uint64
	info  *Info
	name  string
	admin bool
	pid   uint32
	uid   uint32
	gid   uint32
	log   *slog.Logger
	m     *chanmux.Mux // the fd channel: requests, reader, resume

	watchCancel context.CancelFunc
	wg          sync.WaitGroup // the Watch goroutine

	// mu guards regions and mappers. Close marks the Mux closed before it
	// takes the regions under mu, and NewRegion checks the Mux under mu,
	// so no region is added after Close took them.
	mu      sync.Mutex
	regions map[*Region]struct{}
	mappers map[string]mapper
}

// OpenSession opens a session named name (1-128 printable characters; for
// an Ollama runner, the model's sha256 digest). It connects a new fd
// channel, reads the daemon's HELLO and binds the session to it.
func (c *Client) OpenSession(ctx context.Context, name string, opts ...SessionOption) (*Session, error) {
	var o sessionOptions
	for _, opt := range opts {
		opt(&o)
	}
	info, err := c.Info(ctx)
	if err != nil {
		return nil, err
	}
	if info.FDProtocolVersion != 0 && info.FDProtocolVersion != fdchan.Version {
		return nil, newError(ErrProtocol, "OpenSession", "daemon speaks fd protocol %d, this client %d", info.FDProtocolVersion, fdchan.Version)
	}
	if !info.FDChannelRequests {
		return nil, newError(ErrFailedPrecondition, "OpenSession", "the daemon (version %q) takes no page requests on the fd channel "+
			"(GetInfo().fd_channel_requests is false); this client sends Allocate, Free and Close only there: upgrade kvcached-serve", info.Version)
	}
	ch, err := fdchan.Dial(info.FDSocket)
	if err != nil {
		return nil, newError(ErrUnavailable, "OpenSession", "connecting the fd channel %s: %v", info.FDSocket, err)
	}
	hello, err := chanmux.ReadHello(ctx, ch)
	if err != nil {
		ch.Close()
		return nil, err
	}
	resp, err := c.rpc.OpenSession(ctx, &pb.OpenSessionRequest{
		ChannelSecret: hello.Secret[:], Name: name, GuaranteedBytes: o.guaranteed,
		MaxBytes: o.max, Priority: o.priority, Labels: o.labels,
	})
	if err != nil {
		ch.Close()
		return nil, statusToError("OpenSession", err)
	}
	s := &Session{
		c: c, id: resp.GetSession().GetId(), info: info, name: name, admin: resp.GetAdmin(),
		pid: resp.GetPid(), uid: resp.GetUid(), gid: resp.GetGid(),
		regions: map[*Region]struct{}{},
		mappers: map[string]mapper{},
	}
	s.log = c.log.With("session_id", s.id, "session_name", name)
	id, token := s.id, resp.GetResumeToken()
	s.m = chanmux.New(ch, resp.GetSession(), chanmux.Config{
		ID: s.id, FDSocket: info.FDSocket, Log: s.log, ResumeToken: token, ResumeTimeout: o.resumeTimeout,
		Resume: func(ctx context.Context, secret []byte, ids []uint64) (*pb.ResumeSessionResponse, error) {
			return c.rpc.ResumeSession(ctx, &pb.ResumeSessionRequest{
				ChannelSecret: secret, SessionId: id, ResumeToken: token, PageIds: ids,
			}, grpc.WaitForReady(true))
		},
	})
	if o.onReclaim != nil || o.onEvent != nil {
		wctx, cancel := context.WithCancel(context.Background())
		s.watchCancel = cancel
		ready := make(chan struct{})
		s.wg.Add(1)
		go s.watchLoop(wctx, o, ready)
		select {
		case <-ready:
		case <-ctx.Done():
			s.Close(context.Background())
			return nil, statusToError("OpenSession", ctx.Err())
		}
	}
	s.log.Debug("kvcached session opened", "pid", s.pid, "uid", s.uid, "admin", s.admin)
	return s, nil
}

// ID is the session's public id (as in stats).
func (s *Session) ID() uint64 { return s.id }

// Name is the name the session was opened with.
func (s *Session) Name() string { return s.name }

// Admin reports whether the daemon granted admin rights (RequestShrink,
// SetLimits, every session's stats).
func (s *Session) Admin() bool { return s.admin }

// Peer is the (pid, uid, gid) the daemon read from the fd channel.
func (s *Session) Peer() (pid, uid, gid uint32) { return s.pid, s.uid, s.gid }

// Info is the daemon's GetInfo answer as of OpenSession.
func (s *Session) Info() *Info { return s.info }

// Done is closed when the session has ended (Close, or the daemon ended it).
func (s *Session) Done() <-chan struct{} { return s.m.Done() }

// Err is why the session ended (nil while it is open).
func (s *Session) Err() error { return s.m.Err() }

// Page is one page lent to the session: its id and its descriptor (a memfd
// for host devices, a CUDA POSIX handle for cuda devices). The caller owns
// File and must close it once mapped (Region does all of this).
type Page struct {
	ID   uint64
	File *os.File
}

// Allocation is the answer to Allocate.
type Allocation struct {
	ID        uint64
	Device    string
	PageSize  uint64
	Pages     []Page
	HeldBytes uint64 // bytes the session holds on the device afterwards
}

// Close closes every page descriptor still open (not the pages: Free them).
func (a *Allocation) Close() {
	for i := range a.Pages {
		if a.Pages[i].File != nil {
			a.Pages[i].File.Close()
			a.Pages[i].File = nil
		}
	}
}

// IDs returns the page ids in order.
func (a *Allocation) IDs() []uint64 {
	ids := make([]uint64, len(a.Pages))
	for i, p := range a.Pages {
		ids[i] = p.ID
	}
	return ids
}

// AllocOption configures Allocate.
type AllocOption func(*pb.AllocateRequest)

// OnDevice picks the device by UUID (default: the daemon's first device).
func OnDevice(uuid string) AllocOption { return func(r *pb.AllocateRequest) { r.Device = uuid } }

// WaitUpTo lets the daemon reclaim pages from other sessions and wait up
// to d (0 = the daemon's default) before failing with ErrResourceExhausted.
func WaitUpTo(d time.Duration) AllocOption {
	return func(r *pb.AllocateRequest) {
		r.Wait = true
		r.WaitTimeoutMs = uint32(d / time.Millisecond)
	}
}

// Allocate borrows n pages (all or nothing) and returns them with their
// descriptors. Most programs use Region.Map instead.
func (s *Session) Allocate(ctx context.Context, n int, opts ...AllocOption) (*Allocation, error) {
	if n <= 0 || uint64(n) > uint64(^uint32(0)) {
		return nil, newError(ErrInvalidArgument, "Allocate", "num_pages %d out of range", n)
	}
	req := &pb.AllocateRequest{NumPages: uint32(n)}
	for _, opt := range opts {
		opt(req)
	}
	rec := fdchan.AllocateReq{NumPages: req.GetNumPages(), Wait: req.GetWait(),
		Notify: req.GetNotifyWhenAvailable(), WaitTimeoutMs: req.GetWaitTimeoutMs(), Device: req.GetDevice()}
	got, err := s.m.Allocate(ctx, rec)
	if err != nil {
		return nil, err
	}
	a := &Allocation{ID: got.ID, Device: rec.Device, HeldBytes: got.HeldBytes}
	for _, d := range s.info.Devices {
		if d.UUID == rec.Device || rec.Device == "" {
			a.Device, a.PageSize = d.UUID, d.PageSize
			break
		}
	}
	for i, fd := range got.FDs {
		a.Pages = append(a.Pages, Page{ID: got.IDs[i], File: os.NewFile(uintptr(fd), fmt.Sprintf("kvcached-page-%d", got.IDs[i]))})
	}
	return a, nil
}

// FreeResult is the answer to Free.
type FreeResult struct {
	PagesFreed uint64
	// HeldBytes is always 0: a FREE's REPLY counts only the pages freed
	// (Session.Own has the books). Kept for source compatibility.
	HeldBytes uint64
}

// Free gives pages back (all or nothing). Unmap them first. On a
// resumable session whose daemon is away (resuming, or the channel hung
// up after the FREE went out) it succeeds, checked as the daemon would
// (ErrNotFound for a page not held, ErrInvalidArgument for an id named
// twice): the pages are not claimed when the session resumes, which frees
// them. A Free of more than 16384 pages is sent as several FREE records,
// all or nothing each.
func (s *Session) Free(ctx context.Context, ids []uint64) (FreeResult, error) {
	n, err := s.m.Free(ctx, ids)
	return FreeResult{PagesFreed: n}, err
}

// Watch streams the session's events to fn until ctx ends (returns nil) or
// the stream fails (returns the error; ErrClosed-like errors when the
// session ended). The first event is always EventReady. Sessions opened
// with WithReclaimHandler already run a Watch of their own.
func (s *Session) Watch(ctx context.Context, fn func(Event)) error {
	ref, gen, err := s.call("Watch")
	if err != nil {
		return err
	}
	stream, err := s.c.rpc.Watch(ctx, &pb.WatchRequest{Session: ref})
	if err != nil {
		return s.watchErr(ctx, gen, err)
	}
	for {
		e, err := stream.Recv()
		if err != nil {
			if err == io.EOF {
				return newError(ErrClosed, "Watch", "the daemon ended the watch stream")
			}
			return s.watchErr(ctx, gen, err)
		}
		fn(eventFromPB(e))
	}
}

func (s *Session) watchErr(ctx context.Context, gen uint64, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return s.rpcErr("Watch", gen, err)
}

func (s *Session) watchLoop(ctx context.Context, o sessionOptions, ready chan struct{}) {
	defer s.wg.Done()
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
			if o.onEvent != nil {
				o.onEvent(ev)
			}
			if ev.Kind == EventReclaim && o.onReclaim != nil {
				s.log.Info("kvcached reclaim request", "device", ev.Reclaim.Device, "pages", ev.Reclaim.Pages,
					"reason", ev.Reclaim.Reason, "deadline", ev.Reclaim.Deadline)
				rctx, cancel := context.WithDeadline(ctx, ev.Reclaim.Deadline)
				if ev.Reclaim.Deadline.IsZero() {
					rctx, cancel = context.WithCancel(ctx)
				}
				o.onReclaim(rctx, *ev.Reclaim)
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

// Close ends the session: its regions are unmapped and released, the
// daemon is told (a CLOSE request on the fd channel, or CloseSession), the
// fd channel is closed and every
// goroutine of the session has returned when Close returns. Pages go back
// to the daemon's pool. Close is idempotent.
func (s *Session) Close(ctx context.Context) error {
	if !s.m.MarkClosed() {
		return nil
	}
	s.mu.Lock()
	regions := make([]*Region, 0, len(s.regions))
	for r := range s.regions {
		regions = append(regions, r)
	}
	s.mu.Unlock()
	var errs []error
	for _, r := range regions {
		errs = append(errs, r.release(false))
	}
	if s.watchCancel != nil {
		s.watchCancel()
	}
	s.m.Stop() // ends a resume in progress
	ended := s.m.Err() != nil
	// (Not while resuming: the daemon is away, and the session's pages
	// are forgotten when nobody resumes it.)
	if _, _, err := s.m.Call("CloseSession"); !ended && err == nil {
		err = s.m.CloseRequest(ctx)
		if err != nil && !errors.Is(err, ErrFailedPrecondition) && !errors.Is(err, ErrNotFound) {
			errs = append(errs, err)
		}
	}
	s.m.Shutdown()
	s.wg.Wait()
	s.mu.Lock()
	for _, m := range s.mappers {
		m.close()
	}
	s.mappers = nil
	s.mu.Unlock()
	return errors.Join(errs...)
}

// ChannelRequests reports whether the session's Allocate, Free and Close
// go over its fd channel: always, since this client dropped its gRPC page
// path (OpenSession refuses a daemon that does not offer the channel).
func (s *Session) ChannelRequests() bool { return true }

// AnswerReclaim answers the reclaim request id (Reclaim.ID) at once with
// what the session could do: bytesGiven it gave back for it (already
// freed), bytesKept it keeps on that device, and why (at most 1024 bytes).
// It is an ANSWER record on the session's fd channel (docs/protocol.md,
// "The reclaim answer"): the request is settled, nobody waits for the
// rest, and the session is not asked again before the request's deadline.
// It returns the bytes the daemon's books show the session holding on the
// reclaim's device; ErrNotFound for an id this session was never sent (or
// one settled more than 10 minutes ago).
func (s *Session) AnswerReclaim(ctx context.Context, id, bytesGiven, bytesKept uint64, reason string) (heldBytes uint64, err error) {
	return s.m.Answer(ctx, fdchan.AnswerReq{ReclaimID: id, BytesGiven: bytesGiven, BytesKept: bytesKept, Reason: reason})
}

// Resumable reports whether the session survives a daemon restart (the
// daemon keeps a journal: kvcached-serve --state-dir). See
// docs/reliability.md, "Daemon restart with clients alive", and
// internal/chanmux (resume.go).
func (s *Session) Resumable() bool { return s.m.Resumable() }

// Resumes is how many times the session was resumed after a daemon restart.
func (s *Session) Resumes() uint64 { return s.m.Resumes() }

// WaitResumed blocks while the session is being resumed after the daemon
// went away. It returns nil when the session is usable (at once if it is
// not resuming), the reason the session ended (ErrFailedPrecondition when
// the restarted daemon refused the resume, ErrUnavailable when it did not
// come back in time, ErrClosed after Close), or ctx's error.
func (s *Session) WaitResumed(ctx context.Context) error { return s.m.WaitResumed(ctx) }

// call returns the session reference to send with a gRPC call and its
// generation, or the error to return without calling the daemon
// (resuming, or dead after a failed resume).
func (s *Session) call(op string) (*pb.SessionRef, uint64, error) { return s.m.Call(op) }

// rpcErr maps the error of a gRPC call made with the reference of
// generation gen (UNAVAILABLE says the session resumes).
func (s *Session) rpcErr(op string, gen uint64, err error) error { return s.m.RPCErr(op, gen, err) }
