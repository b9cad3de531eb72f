package kvcached

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

var backends = []string{"host", "cuda"}

func forEachBackend(t *testing.T, f func(t *testing.T, backend string)) {
	for _, b := range backends {
		// Started before the test's goroutine count is taken.
		t.Run(b, func(t *testing.T) { sharedDaemon(t, b); f(t, b) })
	}
}

// Sessions, Allocate/Free through a Region, data written and read back,
// the daemon's books before and after.
func TestRegionAgainstDaemon(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		_, c := connect(t, backend)
		regionScenario(t, c, backend)
	})
}

func regionScenario(t *testing.T, c *Client, backend string) {
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-region-test", WithLabels(map[string]string{"model_digest": "sha256:abc"}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	dev := s.Info().Devices[0]
	if dev.Kind != backend {
		t.Fatalf("device kind %q on the %s daemon", dev.Kind, backend)
	}
	ps := dev.PageSize
	r, err := s.NewRegion(ctx, 16*ps)
	if err != nil {
		t.Fatal(err)
	}
	// Grow in llama.cpp-like steps; write a pattern in every page.
	for _, n := range []uint64{1, 3*ps + 5, 8 * ps} {
		if err := r.Grow(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Map(ctx, 12*ps, 2*ps); err != nil { // a second, separate range
		t.Fatal(err)
	}
	own, err := s.Own(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if own.PagesHeld != 10 || own.HeldBytes != 10*ps || own.Labels["model_digest"] != "sha256:abc" {
		t.Fatalf("daemon's books: %+v", own)
	}
	for _, i := range []uint64{0, 1, 2, 3, 4, 5, 6, 7, 12, 13} {
		// Fresh pages read as zeros (invariant 2).
		got := make([]byte, 64)
		if _, err := r.ReadAt(got, int64(i*ps+ps-64)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, make([]byte, 64)) {
			t.Fatalf("page %d is not zero", i)
		}
		if _, err := r.WriteAt(pattern(int(i), int(ps)), int64(i*ps)); err != nil {
			t.Fatal(err)
		}
	}
	for _, i := range []uint64{0, 1, 2, 3, 4, 5, 6, 7, 12, 13} {
		got := make([]byte, ps)
		if _, err := r.ReadAt(got, int64(i*ps)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, pattern(int(i), int(ps))) {
			t.Fatalf("page %d lost its bytes", i)
		}
	}
	if _, err := r.ReadAt(make([]byte, 1), int64(9*ps)); !errors.Is(err, ErrNotMapped) {
		t.Fatalf("read of unmapped page: %v", err)
	}
	if err := r.Trim(ctx, 2*ps); err != nil {
		t.Fatal(err)
	}
	own, _ = s.Own(ctx)
	if own.PagesHeld != 2 {
		t.Fatalf("after trim the daemon says %d pages", own.PagesHeld)
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
	own, _ = s.Own(ctx)
	if own.PagesHeld != 0 {
		t.Fatalf("after close the daemon says %d pages", own.PagesHeld)
	}
	st, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := st.Total
	if p.PooledBytes+p.InUseBytes+p.FreeBytes != p.BudgetBytes {
		t.Fatalf("books do not add up: %+v", p)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Allocate(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Allocate after Close: %v", err)
	}
}

// Large allocations cross several PAGES records (253 fds each): a daemon
// of its own with small pages, so the 256 MiB budget is 1024 pages.
func TestLargeAllocation(t *testing.T) {
	d, err := startDaemon("host", nil, "--page-size", "256KiB")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	checkGoroutines(t)
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-large")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	dev := s.Info().Devices[0]
	n := int(dev.BudgetBytes / dev.PageSize) // the whole budget
	if n <= 3*253 {
		t.Fatalf("budget of %d pages of %d bytes: too few for the test", n, dev.PageSize)
	}
	a, err := s.Allocate(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Pages) != n || a.HeldBytes != uint64(n)*a.PageSize {
		t.Fatalf("%d pages, held %d", len(a.Pages), a.HeldBytes)
	}
	seen := map[uint64]bool{}
	for _, p := range a.Pages {
		if seen[p.ID] || p.File == nil {
			t.Fatalf("page %d repeated or without fd", p.ID)
		}
		seen[p.ID] = true
		if fi, err := p.File.Stat(); err != nil || uint64(fi.Size()) != dev.PageSize {
			t.Fatalf("page %d: memfd of %v bytes (%v)", p.ID, fi.Size(), err)
		}
	}
	a.Close()
	// Budget exhausted now: the next Allocate fails with a sentinel.
	if _, err := s.Allocate(ctx, 1); !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("over budget: %v", err)
	}
	if fr, err := s.Free(ctx, a.IDs()); err != nil || fr.PagesFreed != uint64(n) || fr.HeldBytes != 0 {
		t.Fatalf("free: %+v %v", fr, err)
	}
}

// Data written through a Go mapping is read back by a Python client
// process that maps the same pages (fds inherited from this process).
func TestPythonReadsGoWrites(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		d, c := connect(t, backend)
		ctx := testCtx(t)
		s, err := c.OpenSession(ctx, "go-writer")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		dev := s.Info().Devices[0]
		ps := dev.PageSize
		const n = 3
		a, err := s.Allocate(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		s.regs.mu.Lock()
		m, err := s.regs.mapperLocked(dev)
		s.regs.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		base, err := m.reserve(n * ps)
		if err != nil {
			t.Fatal(err)
		}
		var dups []*os.File
		for i, p := range a.Pages {
			fd, err := unix.Dup(int(p.File.Fd()))
			if err != nil {
				t.Fatal(err)
			}
			dups = append(dups, os.NewFile(uintptr(fd), "dup"))
			if err := m.mapRun(base+uintptr(uint64(i)*ps), pageRun{files: []*os.File{p.File}}, ps); err != nil {
				t.Fatal(err)
			}
			if err := m.write(base+uintptr(uint64(i)*ps), pattern(100+i, int(ps))); err != nil {
				t.Fatal(err)
			}
		}
		script := `
import sys, hashlib
from kvcached_service.client import Client
sock, dev, ps, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
c = Client.connect(sock)
s = c.open_session("py-reader")
m = s.mapper(dev)
base = m.reserve(n * ps)
for i in range(n):
    m.map(base + i * ps, 3 + i, ps)
    print(hashlib.sha256(m.read(base + i * ps, ps)).hexdigest())
sys.stdout.flush()
s.close()
`
		cmd := exec.CommandContext(ctx, filepath.Join(repoRoot, ".venv", "bin", "python"), "-c", script,
			d.Socket, dev.UUID, strconv.FormatUint(ps, 10), strconv.Itoa(n))
		cmd.Dir = repoRoot
		cmd.Env = d.Env
		cmd.ExtraFiles = dups
		out, err := cmd.Output()
		for _, f := range dups {
			f.Close()
		}
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				t.Fatalf("python reader: %v\n%s", err, ee.Stderr)
			}
			t.Fatal(err)
		}
		lines := strings.Fields(string(out))
		if len(lines) != n {
			t.Fatalf("python printed %q", out)
		}
		for i := range lines {
			if want := sha256hex(pattern(100+i, int(ps))); lines[i] != want {
				t.Errorf("page %d: python read %s, Go wrote %s", i, lines[i], want)
			}
		}
		for i := 0; i < n; i++ {
			if err := m.unmap(base+uintptr(uint64(i)*ps), ps); err != nil {
				t.Fatal(err)
			}
		}
		if err := m.release(base, n*ps); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Free(ctx, a.IDs()); err != nil {
			t.Fatal(err)
		}
	})
}

const helperEnv = "KVCACHED_GO_TEST_HELPER"

// helperMain runs in a child process: open a session from the
// environment, map pages, say READY, then wait to be killed.
func helperMain() int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := FromEnv(ctx)
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	s, err := c.OpenSession(ctx, os.Getenv("KVCACHED_SESSION_NAME"))
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	pages, _ := strconv.Atoi(os.Getenv(helperEnv))
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, uint64(pages)*ps)
	if err == nil {
		err = r.Grow(ctx, r.Size())
	}
	if err == nil {
		_, err = r.WriteAt([]byte("alive"), 0)
	}
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	fmt.Println("READY", s.ID())
	time.Sleep(time.Minute)
	return 0
}

// A Go client killed with SIGKILL gets its pages reclaimed within 1 s.
func TestSIGKILLReturnsPages(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		d, c := connect(t, backend)
		sigkillScenario(t, d, c, backend)
	})
}

func sigkillScenario(t *testing.T, d *daemon, c *Client, backend string) {
	ctx := testCtx(t)
	before, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const pages = 20
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append([]string{}, d.Env...), helperEnv+"="+strconv.Itoa(pages),
		EnvOllamaSocket+"="+d.Socket, "KVCACHED_SESSION_NAME=sha256:doomed")
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	if !strings.HasPrefix(line, "READY") {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper: %q", line)
	}
	st, _ := c.Stats(ctx)
	if got := st.Total.PagesInUse - before.Total.PagesInUse; got != pages {
		t.Fatalf("helper holds %d pages, want %d", got, pages)
	}
	killed := time.Now()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	took := waitFor(t, time.Second, "pages returned after SIGKILL", func() (bool, string) {
		st, err := c.Stats(ctx)
		if err != nil {
			return false, err.Error()
		}
		p := st.Total
		return p.PagesInUse == before.Total.PagesInUse && p.PooledBytes+p.InUseBytes+p.FreeBytes == p.BudgetBytes,
			fmt.Sprintf("%+v", p)
	})
	t.Logf("%s: pages back %v after SIGKILL (%v since kill)", backend, took, time.Since(killed))
}

// The reclaim callback is honoured: an admin shrink request and a waiting
// Allocate of another session both get pages from an idle session.
func TestReclaimCallback(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		_, c := connect(t, backend)
		reclaimCallbackScenario(t, c, backend)
	})
}

func reclaimCallbackScenario(t *testing.T, c *Client, backend string) {
	ctx := testCtx(t)
	var region atomic.Pointer[Region]
	var calls atomic.Int32
	reclaims := make(chan Reclaim, 8)
	idle, err := c.OpenSession(ctx, "sha256:idle-runner", WithReclaimHandler(func(ctx context.Context, r Reclaim) {
		calls.Add(1)
		reclaims <- r
		reg := region.Load()
		keep := reg.MappedBytes()
		if want := r.Pages * reg.PageSize(); keep > want {
			keep -= want
		} else {
			keep = 0
		}
		if err := reg.Trim(ctx, keep); err != nil {
			t.Errorf("trim in reclaim handler: %v", err)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close(ctx)
	ps := idle.Info().Devices[0].PageSize
	budget := idle.Info().Devices[0].BudgetBytes / ps
	r, err := idle.NewRegion(ctx, budget*ps)
	if err != nil {
		t.Fatal(err)
	}
	region.Store(r)
	if err := r.Grow(ctx, (budget-10)*ps); err != nil {
		t.Fatal(err)
	}

	admin, err := c.OpenSession(ctx, "ollama-scheduler")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if !admin.Admin() {
		t.Fatalf("the test runs as the daemon's uid, which is always admin")
	}
	// 1. Admin shrink to 20 pages.
	asked, err := admin.RequestShrink(ctx, idle.ID(), 20*ps, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if asked != budget-10-20 {
		t.Fatalf("shrink asked for %d pages, want %d", asked, budget-10-20)
	}
	select {
	case rc := <-reclaims:
		if rc.Reason != "admin" || rc.Pages != asked || rc.Deadline.IsZero() {
			t.Fatalf("reclaim event %+v", rc)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no reclaim callback after RequestShrink")
	}
	waitFor(t, 10*time.Second, "idle session shrunk to 20 pages", func() (bool, string) {
		u, err := idle.Own(ctx)
		return err == nil && u.HeldBytes == 20*ps, fmt.Sprintf("%+v %v", u, err)
	})
}

// A waiting Allocate (wait=true) of a new session is served by reclaim from
// an idle session that answers through its callback (issue 4).
func TestReclaimForWaitingAllocate(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		_, c := connect(t, backend)
		reclaimWaitingScenario(t, c, backend)
	})
}

func reclaimWaitingScenario(t *testing.T, c *Client, backend string) {
	ctx := testCtx(t)
	var region atomic.Pointer[Region]
	var calls atomic.Int32
	idle, err := c.OpenSession(ctx, "sha256:idle-runner-2", WithReclaimHandler(func(ctx context.Context, r Reclaim) {
		calls.Add(1)
		reg := region.Load()
		keep := reg.MappedBytes()
		if want := r.Pages * reg.PageSize(); keep > want {
			keep -= want
		} else {
			keep = 0
		}
		if err := reg.Trim(ctx, keep); err != nil {
			t.Errorf("trim in reclaim handler: %v", err)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close(ctx)
	ps := idle.Info().Devices[0].PageSize
	budget := idle.Info().Devices[0].BudgetBytes / ps
	r, err := idle.NewRegion(ctx, budget*ps)
	if err != nil {
		t.Fatal(err)
	}
	region.Store(r)
	if err := r.Grow(ctx, (budget-10)*ps); err != nil {
		t.Fatal(err)
	}
	busy, err := c.OpenSession(ctx, "sha256:new-runner")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close(ctx)
	start := time.Now()
	a, err := busy.Allocate(ctx, int(budget/2), WaitUpTo(5*time.Second))
	if err != nil {
		t.Fatalf("waiting allocate: %v (reclaim calls %d)", err, calls.Load())
	}
	t.Logf("%s: %d pages moved by reclaim in %v", backend, budget/2, time.Since(start))
	a.Close()
	if calls.Load() < 1 {
		t.Fatalf("reclaim handler called %d times", calls.Load())
	}
}

// Every error path returns a sentinel error.
func TestErrorPaths(t *testing.T) {
	sharedDaemon(t, "host")
	checkGoroutines(t)
	d, c := connect(t, "host")
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-errors")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	maxReq := int(s.Info().MaxPagesPerRequest)

	check := func(what string, err, want error) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Errorf("%s: got %v, want %v", what, err, want)
			return
		}
		var e *Error
		if errors.As(err, &e) && e.Message == "" {
			t.Errorf("%s: no message", what)
		}
	}
	_, err = s.Allocate(ctx, 0)
	check("Allocate(0)", err, ErrInvalidArgument)
	_, err = s.Allocate(ctx, maxReq+1)
	check("Allocate(max+1)", err, ErrInvalidArgument)
	_, err = s.Allocate(ctx, 1, OnDevice("GPU-nope"))
	check("Allocate(unknown device)", err, ErrNotFound)
	_, err = s.Free(ctx, []uint64{1 << 60})
	check("Free(unknown page)", err, ErrNotFound)
	a, err := s.Allocate(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	_, err = s.Free(ctx, []uint64{a.Pages[0].ID, a.Pages[0].ID})
	check("Free(repeated id)", err, ErrInvalidArgument)
	_, err = s.Allocate(ctx, int(s.Info().Devices[0].BudgetBytes/s.Info().Devices[0].PageSize))
	check("Allocate(over budget)", err, ErrResourceExhausted)
	if _, err := s.Free(ctx, a.IDs()); err != nil {
		t.Fatal(err)
	}

	forged := &pb.SessionRef{Id: s.ID(), Token: make([]byte, 32)}
	// A default daemon serves page operations on the fd channel only: the
	// gRPC Free (which this client never makes: a raw call, as a tool
	// would) is refused before any SessionRef is looked at.
	_, err = c.rpc.Free(ctx, &pb.FreeRequest{Session: forged, PageIds: []uint64{1}})
	check("Free with a forged token (gRPC page ops off)", statusToError("Free", err), ErrFailedPrecondition)
	_, err = c.rpc.GetStats(ctx, &pb.GetStatsRequest{Session: forged})
	check("GetStats with a forged token", statusToError("GetStats", err), ErrPermissionDenied)
	other, err := c.OpenSession(ctx, "not-admin-target")
	if err != nil {
		t.Fatal(err)
	}
	_, err = other.RequestShrink(ctx, 1<<40, 0, 0)
	check("RequestShrink(unknown session)", err, ErrNotFound)
	other.Close(ctx)
	_, err = other.Allocate(ctx, 1)
	check("Allocate on a closed session", err, ErrClosed)
	_, err = other.Free(ctx, []uint64{1})
	check("Free on a closed session", err, ErrFailedPrecondition)

	// A channel secret is good for one OpenSession.
	info, _ := c.Info(ctx)
	ch, hello := dialChannel(t, info.FDSocket)
	defer ch.Close()
	if _, err := c.rpc.OpenSession(ctx, &pb.OpenSessionRequest{ChannelSecret: hello[:], Name: "first"}); err != nil {
		t.Fatal(err)
	}
	_, err = c.rpc.OpenSession(ctx, &pb.OpenSessionRequest{ChannelSecret: hello[:], Name: "second"})
	check("OpenSession with a used secret", statusToError("OpenSession", err), ErrFailedPrecondition)
	_, err = c.OpenSession(ctx, "")
	check("OpenSession with an empty name", err, ErrInvalidArgument)

	expired, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	_, err = s.Allocate(expired, 1)
	check("Allocate with an expired deadline", err, ErrDeadlineExceeded)
	check("Allocate with an expired deadline (context)", err, context.DeadlineExceeded)

	t.Setenv(EnvOllamaSocket, "")
	t.Setenv(EnvSocket, "")
	_, err = FromEnv(ctx)
	check("FromEnv without variables", err, ErrNoSocket)
	if err != nil && !strings.Contains(err.Error(), EnvOllamaSocket) {
		t.Errorf("FromEnv error does not name the variables: %v", err)
	}
	_, err = Dial(ctx, filepath.Join(t.TempDir(), "none.sock"))
	check("Dial(missing socket)", err, ErrNoSocket)

	// A socket file nobody answers on: UNAVAILABLE.
	dead := filepath.Join(t.TempDir(), "dead.sock")
	l, err := unixListenAndClose(dead)
	if err != nil {
		t.Fatal(err)
	}
	_ = l
	short, cancel2 := context.WithTimeout(ctx, 2*time.Second)
	defer cancel2()
	_, err = Dial(short, dead)
	if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrDeadlineExceeded) {
		t.Errorf("Dial(dead socket): %v", err)
	}
	_ = d
}
