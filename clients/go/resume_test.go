package kvcached

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// startStateDaemon starts a daemon of its own with a journal in
// dir/state; restart brings it back on the same socket and state dir.
func startStateDaemon(t *testing.T, backend string, args ...string) (d *daemon, restart func(stateDir string) *daemon) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvcgo-resume-")
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "state")
	env := backendEnv(t, backend)
	var cur *daemon
	t.Cleanup(func() {
		if cur != nil {
			cur.Stop()
		}
		os.RemoveAll(dir)
	})
	start := func(stateDir string) *daemon {
		t.Helper()
		d, err := startDaemonIn(dir, backend, env, append([]string{"--state-dir", stateDir}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		cur = d
		return d
	}
	return start(state), start
}

func isResumeUnavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) && strings.Contains(err.Error(), "the daemon is unreachable") &&
		strings.Contains(err.Error(), "pages you hold stay usable")
}

func keptFDs(s *Session) int { return s.m.Kept() }

// SIGKILL the daemon while a session holds region pages with data: the
// data stays readable, calls fail with ErrUnavailable, a Free made while
// the daemon is away is not claimed; the daemon restarted on the same
// socket and state dir gets the session back with the same id and pages,
// the Watch stream (reclaim handler) runs again, Allocate and Free work.
func TestResumeAfterDaemonSIGKILL(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		resumeScenario(t, backend)
	})
}

// resumeScenario is the test with a daemon started with args.
func resumeScenario(t *testing.T, backend string, args ...string) {
	d, restart := startStateDaemon(t, backend, args...)
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	reclaims := make(chan Reclaim, 4)
	s, err := c.OpenSession(ctx, "go-survivor", WithPriority(3), WithGuaranteedBytes(1<<20),
		WithReclaimHandler(func(ctx context.Context, r Reclaim) { reclaims <- r }))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	if !s.Resumable() {
		t.Fatal("a daemon with --state-dir gave no resume token")
	}
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, 16*ps)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Grow(ctx, 8*ps); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 8; i++ {
		if _, err := r.WriteAt(pattern(i, int(ps)), int64(i)*int64(ps)); err != nil {
			t.Fatal(err)
		}
	}
	loose, err := s.Allocate(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	loose.Close()                             // the descriptors; the pages stay the session's
	if err := r.Trim(ctx, 6*ps); err != nil { // a Free that works
		t.Fatal(err)
	}
	if got := keptFDs(s); got != 8 {
		t.Fatalf("%d page descriptors kept for resume, want 8 (6 region + 2 loose)", got)
	}
	// Kept handles (CUDA only): the 8 region pages' (the 2 trimmed were
	// freed with keep); none of host pages.
	keptHandles := map[string]int{"cuda": 8, "host": 0}[backend]
	if got := s.kept.count(); got != keptHandles {
		t.Fatalf("%d page handles kept, want %d", got, keptHandles)
	}

	d.Kill()
	waitFor(t, 5*time.Second, "the session notices the daemon went away", func() (bool, string) {
		return s.m.Resuming(), ""
	})
	// Every kept handle goes before the resume claims pages.
	waitFor(t, 5*time.Second, "kept handles released when the daemon went away", func() (bool, string) {
		n := s.kept.count()
		return n == 0, fmt.Sprintf("%d kept", n)
	})
	// The memory is still there and the region still readable.
	for i := 0; i < 6; i++ {
		got := make([]byte, ps)
		if _, err := r.ReadAt(got, int64(i)*int64(ps)); err != nil || !bytes.Equal(got, pattern(i, int(ps))) {
			t.Fatalf("page %d unreadable or changed while the daemon is down: %v", i, err)
		}
	}
	if _, err := s.Allocate(ctx, 1); !isResumeUnavailable(err) {
		t.Fatalf("Allocate while the daemon is down: %v", err)
	}
	if err := r.Grow(ctx, 10*ps); !isResumeUnavailable(err) {
		t.Fatalf("Region.Grow while the daemon is down: %v", err)
	}
	if _, err := s.Stats(ctx); !isResumeUnavailable(err) {
		t.Fatalf("Stats while the daemon is down: %v", err)
	}
	// A Free while the daemon is away succeeds (docs/protocol.md, "Free
	// while the daemon is away"): the page is not claimed at resume.
	if err := r.Trim(ctx, 5*ps); err != nil {
		t.Fatalf("Trim while the daemon is down: %v", err)
	}
	if r.MappedBytes() != 5*ps {
		t.Fatalf("mapped %d bytes after the Free, want 5 pages", r.MappedBytes())
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err = s.WaitResumed(short)
	cancel()
	if !errors.Is(err, ErrDeadlineExceeded) {
		t.Fatalf("WaitResumed while the daemon is down: %v", err)
	}

	d = restart(filepath.Join(filepath.Dir(d.Socket), "state"))
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := s.WaitResumed(wctx); err != nil {
		t.Fatalf("WaitResumed: %v\n%s", err, d.Log.String())
	}
	if s.Resumes() != 1 {
		t.Fatalf("resumed %d times", s.Resumes())
	}
	own, err := s.Own(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// 5 mapped region pages + 2 loose; the page freed while the daemon
	// was away was not claimed.
	if own.ID != s.ID() || own.PagesHeld != 7 || own.HeldBytes != 7*ps || own.Priority != 3 || own.GuaranteedBytes != 1<<20 {
		t.Fatalf("the restarted daemon's books: %+v", own)
	}
	if got := keptFDs(s); got != 7 {
		t.Fatalf("%d page descriptors kept after the resume, want 7", got)
	}
	for i := 0; i < 5; i++ {
		got := make([]byte, ps)
		if _, err := r.ReadAt(got, int64(i)*int64(ps)); err != nil || !bytes.Equal(got, pattern(i, int(ps))) {
			t.Fatalf("page %d lost its bytes across the resume: %v", i, err)
		}
	}
	if !strings.Contains(d.Log.String(), "resumed by pid") {
		t.Errorf("the daemon's log does not say it resumed the session:\n%s", d.Log.String())
	}
	// The Watch stream runs again: an admin shrink reaches the handler.
	if _, err := s.RequestShrink(ctx, s.ID(), 0, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	select {
	case rc := <-reclaims:
		if rc.Reason != "admin" {
			t.Fatalf("reclaim %+v", rc)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no reclaim callback after the resume: the watch stream did not come back")
	}
	// Fully usable again.
	if err := r.Grow(ctx, 12*ps); err != nil {
		t.Fatal(err)
	}
	// The new daemon's pages are kept again (7 new ones on CUDA).
	if got, want := s.kept.count(), map[string]int{"cuda": 7, "host": 0}[backend]; got != want {
		t.Fatalf("%d page handles kept after the resume, want %d", got, want)
	}
	zero := make([]byte, 64)
	got := make([]byte, 64)
	if _, err := r.ReadAt(got, int64(11*ps)); err != nil || !bytes.Equal(got, zero) {
		t.Fatalf("a new page is not zero: %v", err)
	}
	if _, err := s.Free(ctx, loose.IDs()); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
	own, err = s.Own(ctx)
	if err != nil || own.PagesHeld != 0 {
		t.Fatalf("after freeing everything: %+v %v", own, err)
	}
	if got := keptFDs(s); got != 0 {
		t.Fatalf("%d page descriptors still kept after freeing everything", got)
	}
	st, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p := st.Total; p.PagesInUse != 0 || p.PooledBytes+p.InUseBytes+p.FreeBytes != p.BudgetBytes {
		t.Fatalf("books after the resumed session freed everything: %+v", p)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// A restarted daemon that does not know the session (another state dir)
// refuses the resume: the session ends with ErrFailedPrecondition, the
// mapped memory stays readable.
func TestResumeRefused(t *testing.T) {
	checkGoroutines(t)
	d, restart := startStateDaemon(t, "host")
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-refused", WithEventHandler(func(Event) {}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, 4*ps)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Grow(ctx, 2*ps); err != nil {
		t.Fatal(err)
	}
	r.WriteAt([]byte("still here"), 0)
	d.Kill()
	restart(filepath.Join(filepath.Dir(d.Socket), "other-state")) // its cleanup stops it
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := s.WaitResumed(wctx); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("WaitResumed after a refused resume: %v", err)
	}
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the session did not end")
	}
	if !errors.Is(s.Err(), ErrFailedPrecondition) {
		t.Fatalf("Err: %v", s.Err())
	}
	if _, err := s.Allocate(ctx, 1); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("Allocate on the dead session: %v", err)
	}
	if _, err := s.Stats(ctx); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("Stats on the dead session: %v", err)
	}
	got := make([]byte, 10)
	if _, err := r.ReadAt(got, 0); err != nil || string(got) != "still here" {
		t.Fatalf("mapped memory after a refused resume: %q %v", got, err)
	}
	if got := keptFDs(s); got != 0 {
		t.Fatalf("%d page descriptors kept by a dead session", got)
	}
	s.Close(ctx)
}

// Without --state-dir the daemon gives no resume token: no descriptors
// are kept, and a daemon restart ends the session.
func TestNoResumeWithoutStateDir(t *testing.T) {
	checkGoroutines(t)
	d, err := startDaemon("host", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-not-resumable")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	if s.Resumable() {
		t.Fatal("Resumable without --state-dir")
	}
	a, err := s.Allocate(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	if got := keptFDs(s); got != 0 {
		t.Fatalf("%d descriptors kept by a session that cannot resume", got)
	}
	d.Kill()
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the session did not end when the daemon died")
	}
	if !errors.Is(s.Err(), ErrClosed) || s.Resumes() != 0 {
		t.Fatalf("Err %v, resumes %d", s.Err(), s.Resumes())
	}
	if err := s.WaitResumed(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("WaitResumed on an ended session: %v", err)
	}
}

// Busy clients across a daemon kill: goroutines grow and trim stamped
// regions of two sessions without pause while the daemon is SIGKILLed and
// restarted. No stamp is lost, both sessions resume once, and the daemon's
// books equal what each session maps.
func TestBusyClientsSurviveDaemonKill(t *testing.T) {
	checkGoroutines(t)
	d, restart := startStateDaemon(t, "host")
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var sessions []*Session
	for i := 0; i < 2; i++ {
		s, err := c.OpenSession(ctx, fmt.Sprintf("go-busy-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		sessions = append(sessions, s)
	}
	ps := sessions[0].Info().Devices[0].PageSize
	const regionsPerSession, pagesPerRegion = 2, 8
	type worker struct {
		r               *Region
		ok, unavailable int
		bad             int
		stamps          map[uint64]uint64 // page index -> stamp
		lastErr         error
	}
	var workers []*worker
	for _, s := range sessions {
		for j := 0; j < regionsPerSession; j++ {
			r, err := s.NewRegion(ctx, pagesPerRegion*ps)
			if err != nil {
				t.Fatal(err)
			}
			workers = append(workers, &worker{r: r, stamps: map[uint64]uint64{}})
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for wi, w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := uint64(wi*7919 + 1)
			next := func(n uint64) uint64 { rng = rng*6364136223846793005 + 1442695040888963407; return (rng >> 33) % n }
			stamp := uint64(wi) << 32
			buf := make([]byte, 8)
			for {
				select {
				case <-stop:
					return
				default:
				}
				// Check every stamp, then grow or trim.
				for p, want := range w.stamps {
					if _, err := w.r.ReadAt(buf, int64(p*ps)); err != nil || binary.LittleEndian.Uint64(buf) != want {
						w.bad++
					}
				}
				n := next(pagesPerRegion + 1)
				var err error
				if next(2) == 0 {
					err = w.r.Grow(ctx, n*ps)
				} else {
					err = w.r.Trim(ctx, n*ps)
				}
				for p := uint64(0); p < pagesPerRegion; p++ {
					_, had := w.stamps[p]
					mapped := w.r.IsMapped(p*ps, ps)
					switch {
					case mapped && !had:
						stamp++
						binary.LittleEndian.PutUint64(buf, stamp)
						if _, err := w.r.WriteAt(buf, int64(p*ps)); err != nil {
							w.bad++
						}
						w.stamps[p] = stamp
					case !mapped && had:
						delete(w.stamps, p)
					}
				}
				switch {
				case err == nil:
					w.ok++
				case errors.Is(err, ErrUnavailable):
					w.unavailable++
					time.Sleep(5 * time.Millisecond)
				default:
					w.lastErr = err
					w.bad++
					time.Sleep(5 * time.Millisecond)
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	d.Kill()
	time.Sleep(300 * time.Millisecond)
	d = restart(filepath.Join(filepath.Dir(d.Socket), "state"))
	for _, s := range sessions {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := s.WaitResumed(wctx)
		cancel()
		if err != nil || s.Resumes() != 1 {
			t.Fatalf("session %d: WaitResumed %v, resumes %d\n%s", s.ID(), err, s.Resumes(), d.Log.String())
		}
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	unavailable := 0
	for i, w := range workers {
		if w.bad != 0 || w.ok == 0 {
			t.Errorf("worker %d: %d bad, %d ok, last error %v", i, w.bad, w.ok, w.lastErr)
		}
		unavailable += w.unavailable
	}
	if unavailable == 0 {
		t.Errorf("no call failed with ErrUnavailable: the outage went unnoticed")
	}
	for si, s := range sessions {
		var mapped uint64
		for _, w := range workers[si*regionsPerSession : (si+1)*regionsPerSession] {
			mapped += w.r.MappedBytes() / ps
		}
		own, err := s.Own(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if own.PagesHeld != mapped || uint64(keptFDs(s)) != mapped {
			var ids []uint64
			for _, w := range workers[si*regionsPerSession : (si+1)*regionsPerSession] {
				for _, sl := range w.r.slots {
					if sl.mapped {
						ids = append(ids, sl.id)
					}
				}
			}
			t.Errorf("session %d: the daemon says %d pages, %d descriptors kept, %d mapped: ids %v %s", s.ID(), own.PagesHeld, s.m.Kept(), mapped, ids, s.m.KeptState())
		}
	}
	t.Logf("%d calls failed with ErrUnavailable during the outage", unavailable)
	for _, w := range workers {
		if err := w.r.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	st, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p := st.Total; p.PagesInUse != 0 || p.PooledBytes+p.InUseBytes+p.FreeBytes != p.BudgetBytes {
		t.Fatalf("books at the end: %+v", p)
	}
}

// Close while the daemon is away ends the resume at once, with nothing
// left running.
func TestCloseWhileResuming(t *testing.T) {
	checkGoroutines(t)
	d, _ := startStateDaemon(t, "host")
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-closed-while-away", WithReclaimHandler(func(context.Context, Reclaim) {}))
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.NewRegion(ctx, 4*s.Info().Devices[0].PageSize)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Grow(ctx, 1); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	waitFor(t, 5*time.Second, "resuming", func() (bool, string) { return s.m.Resuming(), "" })
	start := time.Now()
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("Close while resuming took %v", took)
	}
	if err := s.WaitResumed(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("WaitResumed after Close: %v", err)
	}
	if _, err := s.Allocate(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Allocate after Close: %v", err)
	}
	if got := keptFDs(s); got != 0 {
		t.Fatalf("%d descriptors kept after Close", got)
	}
}
