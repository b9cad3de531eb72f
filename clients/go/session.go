package kvcached

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
// is safe for concurrent use.
type Session struct {
	c         *Client
	id        uint64
	info      *Info
	name      string
	admin     bool
	pid       uint32
	uid       uint32
	gid       uint32
	log       *slog.Logger
	resumable bool // the daemon gave a resume token (it keeps a journal)
	// resumeToken proves the session to a restarted daemon; it stays the
	// same across resumes (the SessionRef token changes).
	resumeToken []byte

	watchCancel   context.CancelFunc
	wg            sync.WaitGroup
	readerDone    chan struct{}
	stopCtx       context.Context // ends at Close: interrupts a resume
	stop          context.CancelFunc
	resumeTimeout time.Duration

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
	regions  map[*Region]struct{}
	mappers  map[string]mapper

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
	hello, err := readHello(ctx, ch)
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
		c: c, ref: resp.GetSession(), id: resp.GetSession().GetId(), info: info, name: name, admin: resp.GetAdmin(),
		pid: resp.GetPid(), uid: resp.GetUid(), gid: resp.GetGid(), ch: ch,
		resumable:     len(resp.GetResumeToken()) > 0,
		resumeTimeout: o.resumeTimeout,
		readerDone:    make(chan struct{}),
		allocs:        map[allocKey]*pendingAlloc{},
		waiters:       map[uint64]*waiter{},
		regions:       map[*Region]struct{}{},
		mappers:       map[string]mapper{},
		keep:          map[uint64]kept{},
		deferred:      map[uint64]uint64{},
		lost:          make(chan struct{}),
		resumed:       make(chan struct{}),
	}
	close(s.resumed)
	if s.resumeTimeout <= 0 {
		s.resumeTimeout = 2 * time.Minute
	}
	s.resumeToken = resp.GetResumeToken()
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	s.log = c.log.With("session_id", s.id, "session_name", name)
	s.wg.Add(1)
	go s.readLoop(ch)
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

func readHello(ctx context.Context, ch *fdchan.Conn) (fdchan.Hello, error) {
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
		return fdchan.Hello{}, statusToError("OpenSession", ctx.Err())
	}
	switch r := res.r.(type) {
	case fdchan.Hello:
		return r, nil
	case fdchan.Error:
		return fdchan.Hello{}, statusToError("fd channel", status.Error(codes.Code(r.Code), r.Message))
	case nil:
		if errors.Is(res.err, fdchan.ErrProtocol) {
			return fdchan.Hello{}, newError(ErrProtocol, "OpenSession", "%v", res.err)
		}
		return fdchan.Hello{}, newError(ErrUnavailable, "OpenSession", "fd channel closed before HELLO: %v", res.err)
	default:
		return fdchan.Hello{}, newError(ErrProtocol, "OpenSession", "first record is %T, not HELLO", r)
	}
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
func (s *Session) Done() <-chan struct{} { return s.readerDone }

// Err is why the session ended (nil while it is open).
func (s *Session) Err() error {
	select {
	case <-s.readerDone:
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.endErr
	default:
		return nil
	}
}

// readLoop owns the fd channel's receiving side. When a resumable
// session's channel hangs up (the daemon died) it resumes the session
// (resume.go) and goes on reading the new channel.
func (s *Session) readLoop(ch *fdchan.Conn) {
	defer s.wg.Done()
	for {
		end, hangup := s.readChannel(ch)
		if hangup && s.resumable {
			next, err := s.resume(ch, end)
			if next != nil {
				ch = next
				continue
			}
			if err != nil {
				end = err
			}
		}
		s.finish(ch, end)
		return
	}
}

// readChannel reads records until the channel ends; hangup reports an end
// of stream or a read error rather than a record that ended the session.
func (s *Session) readChannel(ch *fdchan.Conn) (end error, hangup bool) {
	for end == nil {
		r, err := ch.Recv()
		switch r := r.(type) {
		case fdchan.Pages:
			end = s.deliver(r)
		case fdchan.Reply:
			s.replied(r)
		case fdchan.Error:
			end = statusToError("fd channel", status.Error(codes.Code(r.Code), r.Message))
		case fdchan.Goodbye:
			end = endedError("fd channel", "session %d ended: the daemon ended it (GOODBYE: CloseSession or shutdown)", s.id)
		case fdchan.Hello:
			end = newError(ErrProtocol, "fd channel", "second HELLO on one channel")
		case nil:
			s.mu.Lock()
			ended := s.endErr // a protocol error found by a caller, which closed the channel
			s.mu.Unlock()
			switch {
			case ended != nil:
				end = ended
			case errors.Is(err, fdchan.ErrProtocol):
				end = newError(ErrProtocol, "fd channel", "%v", err)
			case !s.resumable:
				end, hangup = endedError("fd channel", "session %d ended: the daemon went away, and without a state dir "+
					"(kvcached-serve --state-dir) a daemon that restarts cannot resume it; open a new session (%v)", s.id, err), true
			default:
				end, hangup = newError(ErrUnavailable, "fd channel", "the daemon closed the fd channel: %v", err), true
			}
		default:
			end = newError(ErrProtocol, "fd channel", "unexpected record %T", r)
		}
	}
	return end, hangup
}

// finish ends the session for good: pending allocations and kept page
// descriptors are closed, Done is closed.
func (s *Session) finish(ch *fdchan.Conn, end error) {
	s.mu.Lock()
	closing := s.closed
	if s.endErr == nil {
		s.endErr = end
	}
	for k, pa := range s.allocs {
		for _, fd := range pa.fds {
			closeFD(fd)
		}
		delete(s.allocs, k)
	}
	for id, k := range s.keep {
		closeFD(k.fd)
		delete(s.keep, id)
	}
	clear(s.waiters)
	if s.resuming {
		s.resuming = false
		close(s.resumed)
	}
	logged := s.resumeErr != nil // resumeFailed said why
	s.mu.Unlock()
	if !closing && !logged {
		s.log.Warn("kvcached session ended by the daemon", "err", end)
	}
	ch.Close()
	close(s.readerDone)
}

func (s *Session) deliver(r fdchan.Pages) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := allocKey{s.gen, r.AllocationID}
	pa := s.allocs[key]
	if pa == nil {
		pa = &pendingAlloc{done: make(chan struct{})}
		s.allocs[key] = pa
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
		return newError(ErrProtocol, "fd channel", "allocation %d: record %d+%d of %d does not fit", r.AllocationID, r.FirstIndex, len(r.FDs), r.Total)
	}
	for i, fd := range r.FDs {
		j := int(r.FirstIndex) + i
		if pa.fds[j] >= 0 {
			fdchan.CloseFDs(r.FDs[i:])
			return newError(ErrProtocol, "fd channel", "allocation %d: page index %d sent twice", r.AllocationID, j)
		}
		pa.ids[j], pa.fds[j] = r.PageIDs[i], fd
		pa.received++
		s.keepLocked(r.PageIDs[i], fd)
	}
	if pa.received == pa.total {
		close(pa.done)
		// Pages nobody waits for are given back as soon as they are
		// complete (the stash rule).
		if !pa.claimed {
			s.dropOrphanLocked(key, pa)
		}
	}
	return nil
}

// dropOrphanLocked gives back an allocation whose Allocate call failed on
// this side (its context ended) after the daemon had already sent it.
func (s *Session) dropOrphanLocked(key allocKey, pa *pendingAlloc) {
	id := key.id
	delete(s.allocs, key)
	for _, fd := range pa.fds {
		closeFD(fd)
	}
	if s.closed {
		return
	}
	ids := pa.ids
	s.log.Info("kvcached: freeing pages of an allocation nobody waits for", "allocation_id", id, "pages", len(ids))
	s.giveBackLocked(ids)
}

// giveBackLocked sends FREE records for pages nobody waits for, at once
// and without waiting for their REPLY (which forgets the pages' kept
// descriptors when it comes). It runs under s.mu, on the reader goroutine
// or a caller's: the send is bounded by one second. While the session is
// resuming the pages are simply not claimed, which frees them.
func (s *Session) giveBackLocked(ids []uint64) {
	if s.ch == nil || s.resuming || s.endErr != nil || s.resumeErr != nil {
		s.deferLocked(ids)
		return
	}
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		chunk := ids[i:min(i+fdchan.MaxFreeIDs, len(ids))]
		seqs := make(map[uint64]uint64, len(chunk))
		for _, id := range chunk {
			if k, ok := s.keep[id]; ok {
				seqs[id] = k.seq
			}
		}
		s.reqSeq++
		req := s.reqSeq
		s.waiters[req] = &waiter{gen: s.gen, done: make(chan struct{}), late: func(r fdchan.Reply) {
			if r.Code == 0 {
				s.unkeepSeqsLocked(seqs)
			} else {
				s.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "code", r.Code, "message", r.Message)
			}
		}}
		if err := s.ch.Send(fdchan.FreeReq{ReqID: req, PageIDs: chunk}, nil, time.Now().Add(time.Second)); err != nil {
			delete(s.waiters, req)
			s.deferLocked(chunk)
			s.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "err", err)
		}
	}
}

// deferLocked: pages the session gave up while it could not tell the
// daemon; the next resume does not claim them.
func (s *Session) deferLocked(ids []uint64) {
	for _, id := range ids {
		if k, ok := s.keep[id]; ok {
			s.deferred[id] = k.seq
		}
	}
}

func closeFD(fd int) {
	if fd >= 0 {
		fdchan.CloseFDs([]int{fd})
	}
}

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
	return s.allocateOnChannel(ctx, req)
}

func (s *Session) allocateDone() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inflight--
	if s.inflight > 0 {
		return
	}
	for key, pa := range s.allocs {
		if !pa.claimed && pa.total > 0 && pa.received == pa.total {
			s.dropOrphanLocked(key, pa)
		}
	}
}

func (s *Session) closedErrLocked(op string) error {
	if s.closed {
		return newError(ErrClosed, op, "session %d is closed", s.id)
	}
	if s.endErr != nil {
		return s.endErr
	}
	return newError(ErrClosed, op, "session %d ended", s.id)
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
	return s.freeOnChannel(ctx, ids)
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
		case <-s.readerDone:
			return
		default:
		}
		if s.resumable && errors.Is(err, ErrUnavailable) {
			// The daemon went away: wait until the session is resumed (or
			// the fd channel's hang-up is noticed, then resumed), then
			// watch again with the new session token.
			if s.resumingNow() {
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
		case <-s.readerDone:
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
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
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
	s.stop() // ends a resume in progress
	ended := s.Err() != nil
	// (Not while resuming: the daemon is away, and the session's pages
	// are forgotten when nobody resumes it.)
	if _, _, err := s.call("CloseSession"); !ended && err == nil {
		err = s.closeOnChannel(ctx)
		if err != nil && !errors.Is(err, ErrFailedPrecondition) && !errors.Is(err, ErrNotFound) {
			errs = append(errs, err)
		}
	}
	s.mu.Lock()
	ch := s.ch
	s.mu.Unlock()
	ch.Close()
	s.wg.Wait()
	s.mu.Lock()
	for _, m := range s.mappers {
		m.close()
	}
	s.mappers = nil
	s.mu.Unlock()
	return errors.Join(errs...)
}
