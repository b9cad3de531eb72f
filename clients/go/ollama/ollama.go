// Package ollama is what Ollama's server (Go) needs from kvcached-serve:
// the environment of a llama-server child (ChildEnv, Handle.RunnerEnv),
// what a runner really holds (Handle.Usage, DigestUsage), whether a new
// runner's guarantee fits (Handle.Fits), and asking idle runners to shrink
// before the scheduler unloads a model (Handle.ShrinkIdle, ShrinkRunner).
// A runner's session is named by the model blob's sha256 digest and
// labelled model_digest=<digest> (ChildEnv arranges it). It is built on the
// kvcached package's public API only; the patch to Ollama
// (integrations/ollama) calls it from a handful of call sites.
package ollama

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	kvcached "github.com/kvcached/kvcached-service/clients/go"
)

// Environment a runner (llama-server child) reads; see ChildEnv.
const (
	EnvSessionName   = "KVCACHED_SESSION_NAME"   // the session name: the model's sha256 digest
	EnvSessionLabels = "KVCACHED_SESSION_LABELS" // k=v,k=v
	EnvGuaranteed    = "KVCACHED_GUARANTEED_BYTES"
	EnvMaxBytes      = "KVCACHED_MAX_BYTES"
	EnvPriority      = "KVCACHED_PRIORITY"
	// LabelModelDigest is the label DigestUsage and Handle.Usage match besides the name.
	LabelModelDigest = "model_digest"
)

// RunnerConfig describes one runner for ChildEnv.
type RunnerConfig struct {
	Socket          string // the daemon's socket (required)
	ModelDigest     string // "sha256:<hex>" of the model blob (required)
	Labels          map[string]string
	GuaranteedBytes uint64
	MaxBytes        uint64
	Priority        int32
}

// ChildEnv returns the variables to append to a llama-server child's
// environment (exec.Cmd.Env) so that it opens its session on the daemon
// under the model's digest. Ollama's children inherit the server's
// environment, so OLLAMA_KVCACHED_SOCKET alone already reaches them; the
// rest says whose pages they are.
func ChildEnv(cfg RunnerConfig) ([]string, error) {
	if cfg.Socket == "" {
		return nil, kvcached.NewError(kvcached.ErrNoSocket, "ChildEnv", "no socket path")
	}
	if !strings.HasPrefix(cfg.ModelDigest, "sha256:") || len(cfg.ModelDigest) != len("sha256:")+64 {
		return nil, kvcached.NewError(kvcached.ErrInvalidArgument, "ChildEnv", "model digest %q is not sha256:<64 hex digits>", cfg.ModelDigest)
	}
	labels := map[string]string{LabelModelDigest: cfg.ModelDigest}
	for k, v := range cfg.Labels {
		if strings.ContainsAny(k, ",=") || strings.ContainsAny(v, ",") {
			return nil, kvcached.NewError(kvcached.ErrInvalidArgument, "ChildEnv", "label %q=%q contains ',' or '='", k, v)
		}
		labels[k] = v
	}
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+labels[k])
	}
	env := []string{
		kvcached.EnvOllamaSocket + "=" + cfg.Socket,
		EnvSessionName + "=" + cfg.ModelDigest,
		EnvSessionLabels + "=" + strings.Join(parts, ","),
	}
	if cfg.GuaranteedBytes > 0 {
		env = append(env, EnvGuaranteed+"="+strconv.FormatUint(cfg.GuaranteedBytes, 10))
	}
	if cfg.MaxBytes > 0 {
		env = append(env, EnvMaxBytes+"="+strconv.FormatUint(cfg.MaxBytes, 10))
	}
	if cfg.Priority != 0 {
		env = append(env, EnvPriority+"="+strconv.FormatInt(int64(cfg.Priority), 10))
	}
	return env, nil
}

// SessionFromEnv reads what ChildEnv set (in a runner written in Go): the
// session name and the options to pass to OpenSession.
func SessionFromEnv() (string, []kvcached.SessionOption, error) {
	name := os.Getenv(EnvSessionName)
	if name == "" {
		return "", nil, kvcached.NewError(kvcached.ErrInvalidArgument, "SessionFromEnv", "%s is not set", EnvSessionName)
	}
	var opts []kvcached.SessionOption
	if v := os.Getenv(EnvSessionLabels); v != "" {
		labels := map[string]string{}
		for _, kv := range strings.Split(v, ",") {
			k, val, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return "", nil, kvcached.NewError(kvcached.ErrInvalidArgument, "SessionFromEnv", "%s: %q is not k=v", EnvSessionLabels, kv)
			}
			labels[k] = val
		}
		opts = append(opts, kvcached.WithLabels(labels))
	}
	for _, e := range []struct {
		name string
		set  func(uint64) kvcached.SessionOption
	}{{EnvGuaranteed, kvcached.WithGuaranteedBytes}, {EnvMaxBytes, kvcached.WithMaxBytes}} {
		if v := os.Getenv(e.name); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return "", nil, kvcached.NewError(kvcached.ErrInvalidArgument, "SessionFromEnv", "%s=%q: %v", e.name, v, err)
			}
			opts = append(opts, e.set(n))
		}
	}
	if v := os.Getenv(EnvPriority); v != "" {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil {
			return "", nil, kvcached.NewError(kvcached.ErrInvalidArgument, "SessionFromEnv", "%s=%q: %v", EnvPriority, v, err)
		}
		opts = append(opts, kvcached.WithPriority(int32(n)))
	}
	return name, opts, nil
}

// RunnerUsage is what the daemon's books say one runner (model) holds.
type RunnerUsage struct {
	ModelDigest string
	Sessions    []kvcached.SessionStats // every open session of the model
	HeldBytes   uint64                  // summed over sessions and devices
	// HeldBytesByDevice: HeldBytes per device uuid (a CUDA runner's GPU,
	// "HOST-0" on the host backend).
	HeldBytesByDevice map[string]uint64
	PagesHeld         uint64
	GuaranteedBytes   uint64 // summed over sessions
	// StandbyBytes: of HeldBytes, what the runner keeps mapped as standby
	// (freed by its KV cache, kept for its next request, given back first
	// when the daemon asks: docs/protocol.md, "Standby pages"), summed over
	// sessions.
	StandbyBytes uint64
	LastActive   time.Time
}

func (u *RunnerUsage) add(ss kvcached.SessionStats) {
	u.Sessions = append(u.Sessions, ss)
	u.HeldBytes += ss.HeldBytes
	u.PagesHeld += ss.PagesHeld
	u.GuaranteedBytes += ss.GuaranteedBytes
	u.StandbyBytes += ss.StandbyBytes
	if u.HeldBytesByDevice == nil {
		u.HeldBytesByDevice = map[string]uint64{}
	}
	for d, n := range ss.HeldBytesByDevice {
		u.HeldBytesByDevice[d] += n
	}
	if ss.LastActive.After(u.LastActive) {
		u.LastActive = ss.LastActive
	}
}

// runnerUsage picks digest's sessions out of a snapshot.
func runnerUsage(st *kvcached.Stats, digest string) RunnerUsage {
	u := RunnerUsage{ModelDigest: digest, HeldBytesByDevice: map[string]uint64{}}
	for _, ss := range st.Sessions {
		if ss.Name == digest || ss.Labels[LabelModelDigest] == digest {
			u.add(ss)
		}
	}
	return u
}

// DigestUsage sums the sessions named digest or labelled
// model_digest=digest, as session s sees them. No admin rights are needed
// for a runner of the caller's own uid: the daemon shows a session the
// other sessions of its uid (Ollama and the llama-server children it
// starts share one), and an admin session sees every uid's.
func DigestUsage(ctx context.Context, s *kvcached.Session, digest string) (RunnerUsage, error) {
	st, err := s.Stats(ctx)
	if err != nil {
		return RunnerUsage{}, err
	}
	return runnerUsage(st, digest), nil
}

// ShrinkRunner asks, through session s (same uid or admin), every session
// of a model to shrink to
// targetBytes each and returns the pages asked for in total. Ollama's
// scheduler calls it for an idle runner before deciding to unload a model.
func ShrinkRunner(ctx context.Context, s *kvcached.Session, digest string, targetBytes uint64, timeout time.Duration) (uint64, error) {
	u, err := DigestUsage(ctx, s, digest)
	if err != nil {
		return 0, err
	}
	var total uint64
	for _, ss := range u.Sessions {
		n, err := s.RequestShrink(ctx, ss.ID, targetBytes, timeout)
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}

// DigestFromBlobPath returns "sha256:<hex>" for an Ollama model blob path
// (".../models/blobs/sha256-<64 hex digits>"), or "" when path is not one.
func DigestFromBlobPath(path string) string {
	base := filepath.Base(path)
	hex, ok := strings.CutPrefix(base, "sha256-")
	if !ok || len(hex) != 64 {
		return ""
	}
	for _, c := range hex {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return ""
		}
	}
	return "sha256:" + hex
}

// DefaultGuaranteeCells is how many cells of one slot a runner is
// guaranteed when RunnerSpec.GuaranteeCells is 0: one batch of Ollama's
// default num_batch (512), so a loaded model can always process a batch.
const DefaultGuaranteeCells = 512

// kvPad is llama.cpp's padding of the cells a graph reads (get_n_kv: 256),
// which is what the llama.cpp hook maps.
const kvPad = 256

// RunnerSpec is the KV cache geometry of one llama-server runner, as
// llama.cpp lays it out: every K and V tensor is [row, cells per slot,
// slots] (llama-server -np N without a unified cache: one stream per slot,
// each of pad256(num_ctx) cells). The hook packs the tensors back to back
// as stock llama.cpp does (tensors smaller than a page share pages) and
// backs cells [0, n) of each tensor and stream with the pages those bytes
// touch.
type RunnerSpec struct {
	ModelDigest string   // "sha256:<hex>" (DigestFromBlobPath)
	RowBytes    []uint64 // bytes of one cell of each K and V tensor, in llama.cpp's order (K0, V0, K1, ...)
	CtxPerSlot  uint64   // num_ctx
	Slots       uint64   // OLLAMA_NUM_PARALLEL
	// GuaranteeCells: cells of one slot the runner keeps whatever other
	// runners need (0 = DefaultGuaranteeCells, at most CtxPerSlot).
	GuaranteeCells uint64
	Priority       int32
	Labels         map[string]string
}

func padCells(n uint64) uint64 { return (n + kvPad - 1) / kvPad * kvPad }

// kvBytes: the bytes of the pages (of size page; 0: the bytes themselves)
// that back cells [0, cells) of the first `streams` streams of every
// tensor, the tensors packed back to back ([row, pad256(CtxPerSlot),
// Slots] each; a multiple of 256 bytes, so ggml's alignment adds nothing).
// A page shared by two tensors counts once, so the worst case is the stock
// KV buffer rounded up to one page.
func (r RunnerSpec) kvBytes(cells, streams, page uint64) uint64 {
	ctx, slots := padCells(r.CtxPerSlot), max(r.Slots, 1)
	var total, off, end uint64 // end: the end of the last page counted
	for _, row := range r.RowBytes {
		for s := range streams {
			lo := off + s*row*ctx
			hi := lo + row*cells
			if hi == lo {
				continue
			}
			if page == 0 {
				total += hi - lo
				continue
			}
			lo = max(lo/page*page, end)
			hi = (hi + page - 1) / page * page
			if hi > lo {
				total += hi - lo
				end = hi
			}
		}
		off += row * ctx * slots
	}
	return total
}

// WorstCaseKVBytes is the KV cache of every slot at full context: what
// llama.cpp reserves up front without the daemon, and the most the hook
// can map (rounded up to one page of size page).
func (r RunnerSpec) WorstCaseKVBytes(page uint64) uint64 {
	return r.kvBytes(padCells(r.CtxPerSlot), max(r.Slots, 1), page)
}

// GuaranteedKVBytes is the KV cache of GuaranteeCells cells of one slot
// (the pages they touch, of size page): what the runner is guaranteed, and what
// Ollama's pre-load estimate counts for it with the daemon.
func (r RunnerSpec) GuaranteedKVBytes(page uint64) uint64 {
	cells := r.GuaranteeCells
	if cells == 0 {
		cells = DefaultGuaranteeCells
	}
	cells = min(cells, max(r.CtxPerSlot, 1))
	return r.kvBytes(padCells(cells), 1, page)
}

// Runner names one loaded runner for the scheduler's calls: its
// model digest and, when known, its llama-server pid (what the daemon
// reads from the fd channel; it tells two runners of one model apart).
type Runner struct {
	ModelDigest string
	PID         int
}

// Handle is the Ollama server's handle on the daemon, one per ollama serve
// process (OLLAMA_KVCACHED_SOCKET). It gives each llama-server child its
// environment, reads what each runner really holds per device, says
// whether a new runner's guarantee fits, and asks idle runners to shrink
// before the scheduler unloads one. It needs no admin rights: the daemon
// shows a session the other sessions of its uid and lets it ask them to
// shrink, and Ollama's children run as Ollama's uid.
//
// It connects on first use and again after the daemon went away (at most
// every RetryInterval). While the daemon cannot be reached, reads return
// ok=false and Ollama keeps its own numbers (the children fall back to
// ordinary memory by themselves); one warning is logged per outage. All
// methods are safe for concurrent use and on a nil *Handle (no daemon
// configured): they then do nothing.
type Handle struct {
	socket string
	log    *slog.Logger
	// MaxAge: how old a stats snapshot may be before a read refreshes it.
	MaxAge time.Duration
	// RetryInterval: the least time between two connection attempts.
	RetryInterval time.Duration
	// CallTimeout bounds each call to the daemon.
	CallTimeout time.Duration

	mu       sync.Mutex // serialises connecting and refreshing
	c        *kvcached.Client
	s        *kvcached.Session
	lastTry  time.Time
	down     bool // an outage was logged
	snap     *kvcached.Stats
	snapAt   time.Time
	pageSize uint64
}

// New returns the handle for socket, or nil when socket is empty
// (the daemon is not in use). Nothing is dialled until first use.
func New(socket string, log *slog.Logger) *Handle {
	if socket == "" {
		return nil
	}
	if log == nil {
		log = slog.Default()
	}
	return &Handle{socket: socket, log: log.With("kvcached_socket", socket), MaxAge: 250 * time.Millisecond,
		RetryInterval: 2 * time.Second, CallTimeout: 2 * time.Second}
}

// FromEnv is New(OLLAMA_KVCACHED_SOCKET).
func FromEnv(log *slog.Logger) *Handle { return New(os.Getenv(kvcached.EnvOllamaSocket), log) }

// Socket is the daemon's socket ("" for a nil handle).
func (o *Handle) Socket() string {
	if o == nil {
		return ""
	}
	return o.socket
}

// Close ends the handle's session and connection.
func (o *Handle) Close() {
	if o == nil {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	o.dropLocked()
}

func (o *Handle) dropLocked() {
	if o.s != nil {
		ctx, cancel := context.WithTimeout(context.Background(), o.CallTimeout)
		_ = o.s.Close(ctx)
		cancel()
		o.s = nil
	}
	if o.c != nil {
		_ = o.c.Close()
		o.c = nil
	}
	o.snap = nil
}

// sessionLocked returns a live session, connecting if needed.
func (o *Handle) sessionLocked(ctx context.Context) (*kvcached.Session, error) {
	if o.s != nil {
		select {
		case <-o.s.Done():
			o.log.Warn("kvcached: the daemon ended Ollama's session; reconnecting on next use", "error", o.s.Err())
			o.dropLocked()
			o.down = true
		default:
			return o.s, nil
		}
	}
	if !o.lastTry.IsZero() && time.Since(o.lastTry) < o.RetryInterval {
		return nil, kvcached.NewError(kvcached.ErrUnavailable, "Ollama", "kvcached-serve at %s unreachable (retrying every %v)", o.socket, o.RetryInterval)
	}
	o.lastTry = time.Now()
	ctx, cancel := context.WithTimeout(ctx, o.CallTimeout)
	defer cancel()
	c, err := kvcached.Dial(ctx, o.socket, kvcached.WithLogger(o.log))
	if err == nil {
		var s *kvcached.Session
		s, err = c.OpenSession(ctx, "ollama-scheduler", kvcached.WithLabels(map[string]string{"role": "ollama"}))
		if err == nil {
			o.c, o.s = c, s
			if devs := s.Info().Devices; len(devs) > 0 {
				o.pageSize = devs[0].PageSize
			}
			if o.down {
				o.log.Info("kvcached: daemon reachable again")
			} else {
				o.log.Info("kvcached: connected", "session", s.ID(), "admin", s.Admin(), "backend", s.Info().Backend)
			}
			o.down = false
			return s, nil
		}
		c.Close()
	}
	if !o.down {
		o.log.Warn("kvcached: daemon unreachable; runners keep their KV cache in ordinary memory and Ollama uses its own estimates until it is back", "error", err)
		o.down = true
	}
	return nil, err
}

// Stats is a snapshot of the daemon's books as Ollama's session sees them
// (its uid's sessions), at most MaxAge old; fresh forces a new one.
func (o *Handle) Stats(ctx context.Context, fresh bool) (*kvcached.Stats, error) {
	if o == nil {
		return nil, kvcached.NewError(kvcached.ErrNoSocket, "Ollama", "no daemon configured")
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if !fresh && o.snap != nil && time.Since(o.snapAt) < o.MaxAge {
		return o.snap, nil
	}
	s, err := o.sessionLocked(ctx)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.CallTimeout)
	defer cancel()
	st, err := s.Stats(ctx)
	if err != nil {
		if isAny(err, kvcached.ErrUnavailable, kvcached.ErrClosed, kvcached.ErrFailedPrecondition, kvcached.ErrNotFound, kvcached.ErrDeadlineExceeded) {
			o.log.Warn("kvcached: stats failed; reconnecting on next use", "error", err)
			o.dropLocked()
			o.down = true
		}
		return nil, err
	}
	o.snap, o.snapAt = st, time.Now()
	return st, nil
}

// PageSize is the daemon's page size (0 until connected once).
func (o *Handle) PageSize(ctx context.Context) uint64 {
	if o == nil {
		return 0
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pageSize == 0 {
		_, _ = o.sessionLocked(ctx)
	}
	return o.pageSize
}

// RunnerEnv returns the variables for a llama-server child (ChildEnv of
// spec, with the guarantee and maximum computed from its geometry and the
// daemon's page size): the runner's session is named by the model digest,
// guaranteed GuaranteedKVBytes and capped at WorstCaseKVBytes, which it can
// never exceed anyway. If the daemon cannot be reached now, the maximum is
// left out (the child then falls back to ordinary memory unless the daemon
// is back by then).
func (o *Handle) RunnerEnv(ctx context.Context, spec RunnerSpec) ([]string, error) {
	if o == nil {
		return nil, nil
	}
	page := o.PageSize(ctx)
	cfg := RunnerConfig{Socket: o.socket, ModelDigest: spec.ModelDigest, Labels: spec.Labels, Priority: spec.Priority,
		GuaranteedBytes: spec.GuaranteedKVBytes(page)}
	if page > 0 {
		cfg.MaxBytes = spec.WorstCaseKVBytes(page)
	}
	return ChildEnv(cfg)
}

// Usage is what runner r holds according to the daemon (a snapshot at most
// MaxAge old): its session found by pid, else every session of its digest.
// ok is false when the daemon cannot be asked or has no session of r (the
// runner fell back to ordinary memory, or has not opened it yet): the
// caller then keeps its own numbers.
// A snapshot that does not know r yet (a runner that opened its session
// after it was taken) is replaced by a fresh one.
func (o *Handle) Usage(ctx context.Context, r Runner) (u RunnerUsage, ok bool) {
	return o.usage(ctx, r, false)
}

// UsageNow is Usage from a snapshot taken now: for what a user reads
// (`ollama ps` right after a request), which must not lag the daemon's
// books by one snapshot. It costs one GetStats.
func (o *Handle) UsageNow(ctx context.Context, r Runner) (u RunnerUsage, ok bool) {
	return o.usage(ctx, r, true)
}

func (o *Handle) usage(ctx context.Context, r Runner, fresh bool) (RunnerUsage, bool) {
	if o == nil {
		return RunnerUsage{}, false
	}
	st, err := o.Stats(ctx, fresh)
	if err != nil {
		return RunnerUsage{}, false
	}
	if u, ok := usageOf(st, r); ok || fresh {
		return u, ok
	}
	if st, err = o.Stats(ctx, true); err != nil {
		return RunnerUsage{}, false
	}
	return usageOf(st, r)
}

func usageOf(st *kvcached.Stats, r Runner) (RunnerUsage, bool) {
	if r.PID > 0 {
		u := RunnerUsage{ModelDigest: r.ModelDigest, HeldBytesByDevice: map[string]uint64{}}
		for _, ss := range st.Sessions {
			if int(ss.PID) == r.PID {
				u.add(ss)
			}
		}
		if len(u.Sessions) > 0 {
			return u, true
		}
	}
	if r.ModelDigest == "" {
		return RunnerUsage{}, false
	}
	u := runnerUsage(st, r.ModelDigest)
	return u, len(u.Sessions) > 0
}

// Fit is the daemon's answer to "can a runner guaranteed Need bytes start
// now" on one device.
type Fit struct {
	Device     string // device uuid
	Need       uint64 // the new runner's guarantee
	Budget     uint64 // the device's budget
	Unheld     uint64 // budget no session holds (pooled + never created)
	Guaranteed uint64 // guarantees of the sessions Ollama can see
	// Fits: Need <= Unheld and the guarantees (with Need) stay within
	// the budget.
	Fits bool
}

// Fits says whether a runner guaranteed need bytes fits on the daemon's
// device (uuid; "" = the first device, where the hook opens its session
// unless KVCACHED_DEVICE says otherwise) without anyone giving pages back.
func (o *Handle) Fits(ctx context.Context, need uint64, device string) (Fit, error) {
	if o == nil {
		return Fit{}, kvcached.NewError(kvcached.ErrNoSocket, "Ollama", "no daemon configured")
	}
	st, err := o.Stats(ctx, true)
	if err != nil {
		return Fit{}, err
	}
	return fitOf(st, need, device)
}

func fitOf(st *kvcached.Stats, need uint64, device string) (Fit, error) {
	if len(st.Devices) == 0 {
		return Fit{}, kvcached.NewError(kvcached.ErrNotFound, "Ollama", "the daemon reports no device")
	}
	d := st.Devices[0]
	if device != "" {
		found := false
		for _, x := range st.Devices {
			if x.Device.UUID == device {
				d, found = x, true
			}
		}
		if !found {
			return Fit{}, kvcached.NewError(kvcached.ErrNotFound, "Ollama", "the daemon has no device %q", device)
		}
	}
	f := Fit{Device: d.Device.UUID, Need: need, Budget: d.Pool.BudgetBytes, Unheld: d.Pool.PooledBytes + d.Pool.FreeBytes}
	for _, ss := range st.Sessions {
		f.Guaranteed += ss.GuaranteedBytes
	}
	f.Fits = need <= f.Unheld && f.Guaranteed+need <= f.Budget
	return f, nil
}

// ShrinkResult reports a ShrinkIdle.
type ShrinkResult struct {
	Asked   int    // sessions asked to shrink
	Pages   uint64 // pages asked for
	Freed   uint64 // bytes the asked sessions gave back
	Fit     Fit    // the device after shrinking (Fit.Need = need)
	Elapsed time.Duration
}

// ShrinkIdle asks the sessions of the idle runners to shrink to their
// guarantee (the daemon never asks below it) and waits, at most wait, until
// a runner guaranteed need bytes fits on device or the runners have given
// back what they were asked for. The scheduler calls it before unloading
// an idle runner to make room, and unloads only if res.Fit.Fits is false.
func (o *Handle) ShrinkIdle(ctx context.Context, idle []Runner, need uint64, device string, wait time.Duration) (ShrinkResult, error) {
	var res ShrinkResult
	if o == nil {
		return res, kvcached.NewError(kvcached.ErrNoSocket, "Ollama", "no daemon configured")
	}
	start := time.Now()
	st, err := o.Stats(ctx, true)
	if err != nil {
		return res, err
	}
	held := map[uint64]uint64{}
	for _, r := range idle {
		u, ok := usageOf(st, r)
		if !ok {
			continue
		}
		for _, ss := range u.Sessions {
			if ss.HeldBytes <= ss.GuaranteedBytes {
				continue
			}
			o.mu.Lock()
			s := o.s
			o.mu.Unlock()
			if s == nil {
				return res, kvcached.NewError(kvcached.ErrUnavailable, "Ollama", "the session to the daemon ended")
			}
			cctx, cancel := context.WithTimeout(ctx, o.CallTimeout)
			n, err := s.RequestShrink(cctx, ss.ID, 0, wait)
			cancel()
			if err != nil {
				if isAny(err, kvcached.ErrNotFound) { // the runner just went away
					continue
				}
				return res, err
			}
			if n > 0 {
				res.Asked++
				res.Pages += n
				held[ss.ID] = ss.HeldBytes
				o.log.Info("kvcached: asked an idle runner to shrink before unloading anything", "model", r.ModelDigest,
					"pid", ss.PID, "session", ss.ID, "held", ss.HeldBytes, "guaranteed", ss.GuaranteedBytes, "pages", n)
			}
		}
	}
	deadline := start.Add(wait)
	lastUnheld, polls := uint64(0), 0
	for {
		st, err = o.Stats(ctx, true)
		if err != nil {
			return res, err
		}
		if res.Fit, err = fitOf(st, need, device); err != nil {
			return res, err
		}
		var freed uint64
		pending := false
		for _, ss := range st.Sessions {
			if before, ok := held[ss.ID]; ok {
				if ss.HeldBytes < before {
					freed += before - ss.HeldBytes
				}
				if ss.ReclaimPendingPages > 0 {
					pending = true
				}
			}
		}
		res.Freed = freed
		for id, before := range held { // an asked session that ended (its runner exited) freed everything
			found := false
			for _, ss := range st.Sessions {
				found = found || ss.ID == id
			}
			if !found {
				res.Freed += before
			}
		}
		// Done when it fits, when time is up, or when nothing is pending and
		// the pool has settled (freed pages may be zeroed before they count
		// as unheld).
		settled := !pending && polls > 0 && res.Fit.Unheld == lastUnheld
		if res.Fit.Fits || settled || time.Now().After(deadline) {
			res.Elapsed = time.Since(start)
			return res, nil
		}
		lastUnheld, polls = res.Fit.Unheld, polls+1
		select {
		case <-ctx.Done():
			return res, kvcached.NewError(kvcached.ErrCanceled, "Ollama", "%v", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// isAny reports whether err matches any of the targets.
func isAny(err error, targets ...error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}
