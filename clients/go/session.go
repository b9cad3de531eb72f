package kvcached

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"google.golang.org/grpc"

	"github.com/kvcached/kvcached-service/clients/go/internal/chanmux"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

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
// the Session turns what the Mux returns into this package's types and
// runs the gRPC calls (admin.go, Watch). Its regions and their mappers are
// its regionSet (regions.go), the goroutine behind WithReclaimHandler its
// watcher (watch.go).
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
	regs  *regionSet   // the regions and mappers
	kept  *keptHandles // kept handles of CUDA pages (handles.go)
	watch *watcher     // the Watch goroutine (nil without handlers)
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
	}
	s.regs = newRegionSet(s)
	s.log = c.log.With("session_id", s.id, "session_name", name)
	s.kept = newKeptHandles(info.FDChannelKeepHandles, keepLimitFromEnv(s.log), s.log)
	id, token := s.id, resp.GetResumeToken()
	s.m = chanmux.New(ch, resp.GetSession(), chanmux.Config{
		ID: s.id, FDSocket: info.FDSocket, Log: s.log, ResumeToken: token, ResumeTimeout: o.resumeTimeout,
		Handles: s.kept,
		Resume: func(ctx context.Context, secret []byte, ids []uint64) (*pb.ResumeSessionResponse, error) {
			return c.rpc.ResumeSession(ctx, &pb.ResumeSessionRequest{
				ChannelSecret: secret, SessionId: id, ResumeToken: token, PageIds: ids,
			}, grpc.WaitForReady(true))
		},
	})
	if o.onReclaim != nil || o.onEvent != nil {
		var ready <-chan struct{}
		s.watch, ready = startWatcher(s, o.onEvent, o.onReclaim)
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
	gen       uint64 // the fd channel generation the pages came on (kept handles)
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
	a := &Allocation{ID: got.ID, Device: rec.Device, HeldBytes: got.HeldBytes, gen: got.Gen}
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

// Standby keeps held pages as standby (docs/protocol.md, "Standby
// pages"): a FREE with the standby flag. The pages stay the session's and
// mapped wherever they are mapped, not in use: the daemon counts them as
// standby (SessionStats.StandbyBytes) and a reclaim asks sessions with
// standby pages first. Checked as a Free (all or nothing, ErrNotFound for
// a page not held, ErrInvalidArgument for an id named twice), but it does
// not succeed while the daemon is away (ErrUnavailable: the pages stay in
// use). It returns the pages named; ErrFailedPrecondition where the
// daemon does not offer standby pages (Info.FDChannelStandby is false).
// Use takes them back. After a resume the session says again which of its
// pages it keeps as standby (the restarted daemon does not journal it).
// Most programs use Region.UnmapStandby or Region.TrimStandby instead.
func (s *Session) Standby(ctx context.Context, ids []uint64) (uint64, error) {
	if !s.info.FDChannelStandby {
		return 0, newError(ErrFailedPrecondition, "Standby", "kvcached-serve %q keeps no standby pages (GetInfo().fd_channel_standby is false)", s.info.Version)
	}
	return s.m.Standby(ctx, ids)
}

// Use tells the daemon that standby pages are in use again: USE records,
// not waited for (their REPLY is dropped; the pages were the session's all
// along, the record only corrects the daemon's books). Nothing is sent
// while the session is closed or resuming (the restarted daemon counts
// every page in use), nor where the daemon does not offer standby pages.
func (s *Session) Use(ids []uint64) {
	if len(ids) > 0 && s.info.FDChannelStandby {
		s.m.Use(ids)
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
	var errs []error
	for _, r := range s.regs.list() {
		errs = append(errs, r.release(false))
	}
	s.watch.stop()
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
	s.watch.wait()
	s.regs.closeMappers()
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

// KeptHandles is how many imported CUDA page handles the session keeps for
// pages it freed or holds (README.md, "Kept handles (CUDA)"); 0 where the
// daemon does not offer it, with KVCACHED_KEEP_HANDLES=0, on host devices,
// and once the session has ended.
func (s *Session) KeptHandles() int { return s.kept.count() }

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
