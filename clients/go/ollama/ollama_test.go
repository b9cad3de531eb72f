package ollama

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	kvcached "github.com/kvcached/kvcached-service/clients/go"
	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// The Ollama server's side (this package): geometry, lookups and the Ollama
// handle against a real daemon that runs as another uid, so that this
// process, like an Ollama that was not made an admin, sees and shrinks its
// own runners only through the same-uid rule.

func TestMain(m *testing.M) {
	if os.Getenv(runnerHelperEnv) != "" {
		os.Exit(runnerHelperMain())
	}
	if os.Getenv(asNobodyEnv) != "" {
		if err := dropPrivileges(); err != nil {
			fmt.Fprintln(os.Stderr, "dropping privileges:", err)
			os.Exit(2)
		}
	}
	os.Exit(m.Run())
}

func TestDigestFromBlobPath(t *testing.T) {
	hex := strings.Repeat("0123456789abcdef", 4)
	for path, want := range map[string]string{
		"/root/.ollama/models/blobs/sha256-" + hex: "sha256:" + hex,
		"sha256-" + hex:                     "sha256:" + hex,
		"/x/sha256-" + hex[:63]:             "",
		"/x/sha256-" + strings.ToUpper(hex): "",
		"/x/model.gguf":                     "",
		"/x/sha256:" + hex:                  "",
	} {
		if got := DigestFromBlobPath(path); got != want {
			t.Errorf("DigestFromBlobPath(%q) = %q, want %q", path, got, want)
		}
	}
}

// The geometry is what the llama.cpp hook maps (docs/llama-cpp.md): the
// tensors packed back to back, cells padded to 256, the pages the used
// cells touch (a page shared by two tensors counted once). The numbers are
// those of tests/llama (tiny model: 4 layers x K,V rows of 512 B).
func TestRunnerSpecKVBytes(t *testing.T) {
	rows := make([]uint64, 8)
	for i := range rows {
		rows[i] = 512
	}
	spec := RunnerSpec{RowBytes: rows, CtxPerSlot: 4096, Slots: 2}
	const kib = 1 << 10
	// no paging: 8 tensors x 2 slots x 4096 cells x 512 B = 32 MiB
	if got := spec.WorstCaseKVBytes(0); got != 32<<20 {
		t.Fatalf("worst case %d", got)
	}
	// 64 KiB pages: 4096 x 512 B = 2 MiB per tensor and stream, exact
	if got := spec.WorstCaseKVBytes(64 * kib); got != 32<<20 {
		t.Fatalf("worst case, 64 KiB pages: %d", got)
	}
	// guarantee: 512 cells of one slot: 8 x 256 KiB = 2 MiB
	if got := spec.GuaranteedKVBytes(64 * kib); got != 2<<20 {
		t.Fatalf("guarantee %d", got)
	}
	// 2 MiB pages: each tensor (4 MiB, page aligned here) starts a page
	if got := spec.GuaranteedKVBytes(2 << 20); got != 8*(2<<20) {
		t.Fatalf("guarantee, 2 MiB pages: %d", got)
	}
	// num_ctx 100 -> padded to 256 cells per stream; guarantee limited by the context
	small := RunnerSpec{RowBytes: rows, CtxPerSlot: 100, Slots: 3, GuaranteeCells: 4096}
	if got, want := small.WorstCaseKVBytes(0), uint64(8*3*256*512); got != want {
		t.Fatalf("small worst case %d, want %d", got, want)
	}
	if got, want := small.GuaranteedKVBytes(0), uint64(8*256*512); got != want {
		t.Fatalf("small guarantee %d, want %d", got, want)
	}
	// tensors smaller than a page share pages: 8 x 4096 x 64 B = 2 MiB in
	// all, one 2 MiB page (one page per tensor would be 16 MiB)
	tiny := RunnerSpec{RowBytes: []uint64{64, 64, 64, 64, 64, 64, 64, 64}, CtxPerSlot: 4096, Slots: 1}
	if got := tiny.WorstCaseKVBytes(2 << 20); got != 2<<20 {
		t.Fatalf("tiny worst case %d", got)
	}
	if got := tiny.GuaranteedKVBytes(2 << 20); got != 2<<20 {
		t.Fatalf("tiny guarantee %d", got)
	}
	// rows that do not divide the page: 3 tensors of 1024 x 1000 B =
	// 15.6 pages of 64 KiB each; packed they take 46.9 -> 47 pages (the
	// stock 3,072,000 B rounded up to one page), not 3 x 16
	odd := RunnerSpec{RowBytes: []uint64{1000, 1000, 1000}, CtxPerSlot: 1000, Slots: 1}
	if got, want := odd.WorstCaseKVBytes(64*kib), uint64(47*64*kib); got != want {
		t.Fatalf("odd worst case %d, want %d", got, want)
	}
	// 512 cells of each: [0, 512000) -> pages 0-7, [1024000, 1536000) ->
	// 15-23, [2048000, 2560000) -> 31-39: 8 + 9 + 9 pages
	if got, want := odd.GuaranteedKVBytes(64*kib), uint64(26*64*kib); got != want {
		t.Fatalf("odd guarantee %d, want %d", got, want)
	}
	// never above stock rounded up to one page, whatever the shape
	for _, r := range []RunnerSpec{spec, small, tiny, odd} {
		for _, page := range []uint64{4 * kib, 64 * kib, 2 << 20} {
			stock := r.WorstCaseKVBytes(0)
			if got := r.WorstCaseKVBytes(page); got > (stock+page-1)/page*page {
				t.Fatalf("%v at %d: %d above stock %d", r.RowBytes, page, got, stock)
			}
			if r.GuaranteedKVBytes(page) > r.WorstCaseKVBytes(page) {
				t.Fatalf("%v at %d: guarantee above the worst case", r.RowBytes, page)
			}
		}
	}
}

func TestUsageAndFitFromSnapshot(t *testing.T) {
	d := "sha256:" + strings.Repeat("a", 64)
	st := &kvcached.Stats{
		Devices: []kvcached.DeviceStats{
			{Device: kvcached.Device{UUID: "GPU-0"}, Pool: kvcached.PoolStats{BudgetBytes: 100, PooledBytes: 10, InUseBytes: 60, FreeBytes: 30}},
			{Device: kvcached.Device{UUID: "GPU-1"}, Pool: kvcached.PoolStats{BudgetBytes: 100, FreeBytes: 100}},
		},
		Sessions: []kvcached.SessionStats{
			{ID: 1, Name: "ollama-scheduler", PID: 10},
			{ID: 2, Name: d, PID: 20, HeldBytes: 40, GuaranteedBytes: 8, StandbyBytes: 6, HeldBytesByDevice: map[string]uint64{"GPU-0": 40}},
			{ID: 3, Name: "other", PID: 21, HeldBytes: 20, GuaranteedBytes: 4, StandbyBytes: 3, Labels: map[string]string{LabelModelDigest: d},
				HeldBytesByDevice: map[string]uint64{"GPU-0": 15, "GPU-1": 5}},
		},
	}
	u, ok := usageOf(st, Runner{ModelDigest: d, PID: 21})
	if !ok || len(u.Sessions) != 1 || u.HeldBytes != 20 || u.HeldBytesByDevice["GPU-1"] != 5 || u.StandbyBytes != 3 {
		t.Fatalf("by pid: %+v %v", u, ok)
	}
	u, ok = usageOf(st, Runner{ModelDigest: d, PID: 99}) // pid unknown: every session of the digest
	if !ok || u.HeldBytes != 60 || u.GuaranteedBytes != 12 || u.HeldBytesByDevice["GPU-0"] != 55 || u.StandbyBytes != 9 {
		t.Fatalf("by digest: %+v %v", u, ok)
	}
	if _, ok := usageOf(st, Runner{ModelDigest: "sha256:" + strings.Repeat("b", 64)}); ok {
		t.Fatal("a runner without a session must not be found")
	}
	f, err := fitOf(st, 40, "")
	if err != nil || f.Device != "GPU-0" || f.Unheld != 40 || f.Guaranteed != 12 || !f.Fits {
		t.Fatalf("fit 40: %+v %v", f, err)
	}
	if f, _ := fitOf(st, 41, ""); f.Fits {
		t.Fatalf("fit 41 > unheld 40: %+v", f)
	}
	if f, _ := fitOf(st, 89, "GPU-1"); f.Fits { // unheld 100, but guarantees 12+89 > budget
		t.Fatalf("guarantees over budget must not fit: %+v", f)
	}
	if _, err := fitOf(st, 1, "GPU-9"); !errors.Is(err, kvcached.ErrNotFound) {
		t.Fatalf("unknown device: %v", err)
	}
}

func TestNilHandleIsOff(t *testing.T) {
	var o *Handle
	if New("", nil) != nil {
		t.Fatal("no socket: nil handle")
	}
	ctx := context.Background()
	if env, err := o.RunnerEnv(ctx, RunnerSpec{}); env != nil || err != nil {
		t.Fatal(env, err)
	}
	if _, ok := o.Usage(ctx, Runner{PID: 1}); ok {
		t.Fatal("usage from nil")
	}
	if _, err := o.Fits(ctx, 1, ""); !errors.Is(err, kvcached.ErrNoSocket) {
		t.Fatal(err)
	}
	if _, err := o.ShrinkIdle(ctx, nil, 1, "", time.Second); !errors.Is(err, kvcached.ErrNoSocket) {
		t.Fatal(err)
	}
	o.Close()
	if o.Socket() != "" || o.PageSize(ctx) != 0 {
		t.Fatal("nil handle has a socket")
	}
}

// asNobodyEnv: the test binary was re-run as uid:gid (TestMain drops to
// it first) to play a non-admin Ollama against the daemon at
// nobodySocketEnv.
const (
	asNobodyEnv     = "KVCACHED_GO_TEST_AS_UID"
	nobodySocketEnv = "KVCACHED_GO_TEST_NOBODY_SOCKET"
)

// dropPrivileges runs first in a test binary started with asNobodyEnv.
func dropPrivileges() error {
	var uid, gid int
	if _, err := fmt.Sscanf(os.Getenv(asNobodyEnv), "%d:%d", &uid, &gid); err != nil {
		return fmt.Errorf("%s=%q: %v", asNobodyEnv, os.Getenv(asNobodyEnv), err)
	}
	if err := syscall.Setgroups(nil); err != nil {
		return err
	}
	if err := syscall.Setgid(gid); err != nil {
		return err
	}
	return syscall.Setuid(uid)
}

// runAsNobody re-runs test name of this binary as uid nobody against the
// daemon at socket (the daemon runs as root, so nobody is not its admin).
// The binary is copied where nobody can execute it (go test's build
// directory is private to root).
func runAsNobody(t *testing.T, name, socket string) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Fatal("this test runs a client as uid nobody and needs root (CI runs as root)")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "kvcgo-nobody-bin-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "ollama.test")
	data, err := os.ReadFile(os.Args[0])
	if err == nil {
		err = os.WriteFile(bin, data, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^"+name+"$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), asNobodyEnv+"="+nobody.Uid+":"+nobody.Gid, nobodySocketEnv+"="+socket, "TMPDIR=/tmp")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	t.Logf("as nobody:\n%s", out)
	if err != nil || !strings.Contains(string(out), "--- PASS: "+name) {
		t.Fatalf("%s as nobody failed: %v", name, err)
	}
}

// rootDaemonForNobody starts a daemon (as root) whose sockets any uid can
// open; the daemon's own uid is its only admin.
func rootDaemonForNobody(t *testing.T, dir string, args ...string) *testdaemon.Daemon {
	t.Helper()
	os.Chmod(dir, 0o777)
	d, err := testdaemon.StartIn(dir, "host", nil, append([]string{"--socket-mode", "0666"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Stop)
	d.LogOnFailure(t)
	return d
}

// runnerHelperEnv makes the test binary a fake llama-server runner: it
// opens its session from the environment ChildEnv / Ollama.RunnerEnv set
// (SessionFromEnv), maps the number of pages given, answers reclaim
// requests by trimming, says READY and waits to be killed.
const runnerHelperEnv = "KVCACHED_GO_TEST_RUNNER"

func runnerHelperMain() int {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := kvcached.FromEnv(ctx)
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	name, opts, err := SessionFromEnv()
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	var region atomic.Pointer[kvcached.Region]
	opts = append(opts, kvcached.WithReclaimHandler(func(ctx context.Context, r kvcached.Reclaim) {
		if reg := region.Load(); reg != nil {
			keep := uint64(0)
			if want := r.Pages * reg.PageSize(); reg.MappedBytes() > want {
				keep = reg.MappedBytes() - want
			}
			_ = reg.Trim(ctx, keep)
		}
	}))
	s, err := c.OpenSession(ctx, name, opts...)
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	pages, _ := strconv.Atoi(os.Getenv(runnerHelperEnv))
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, uint64(pages)*ps)
	if err == nil {
		err = r.Grow(ctx, r.Size())
	}
	if err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	region.Store(r)
	fmt.Println("READY", s.ID())
	time.Sleep(time.Minute)
	return 0
}

type fakeRunner struct {
	cmd *exec.Cmd
	pid int
	id  uint64
}

func startFakeRunner(t *testing.T, env []string, pages int) *fakeRunner {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), env...), runnerHelperEnv+"="+strconv.Itoa(pages))
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	var id uint64
	if _, err := fmt.Sscanf(line, "READY %d", &id); err != nil {
		t.Fatalf("runner helper: %q", line)
	}
	return &fakeRunner{cmd: cmd, pid: cmd.Process.Pid, id: id}
}

// The whole Ollama-side flow without admin rights: RunnerEnv for two
// runners, their usage per device found by pid, SetLimits refused, a fit
// that fails until ShrinkIdle asks the idle runner to shrink to its
// guarantee, and the usage following every change (no stale snapshot).
func TestOllamaHandleWithoutAdmin(t *testing.T) {
	socket := os.Getenv(nobodySocketEnv)
	if socket == "" { // as root: start the daemon, then this test again as nobody
		dir, err := os.MkdirTemp("", "kvcgo-noadmin-")
		if err != nil {
			t.Fatal(err)
		}
		d := rootDaemonForNobody(t, dir, "--memory-limit", "4MiB", "--page-size", "64KiB", "--reclaim-timeout-ms", "3000")
		runAsNobody(t, "TestOllamaHandleWithoutAdmin", d.Socket)
		return
	}
	testdaemon.CheckGoroutines(t)
	const page = 64 << 10
	o := New(socket, nil)
	defer o.Close()
	ctx := testdaemon.Ctx(t)
	st, err := o.Stats(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	if o.s.Admin() {
		t.Fatal("the daemon runs as nobody: this process must not be its admin")
	}
	if len(st.Sessions) != 1 || st.Sessions[0].Name != "ollama-scheduler" {
		t.Fatalf("sessions: %+v", st.Sessions)
	}
	if o.PageSize(ctx) != page {
		t.Fatalf("page size %d", o.PageSize(ctx))
	}
	rows := []uint64{1024, 1024} // one layer: K and V rows of 1 KiB
	digestA := "sha256:" + strings.Repeat("a", 64)
	digestB := "sha256:" + strings.Repeat("b", 64)
	specA := RunnerSpec{ModelDigest: digestA, RowBytes: rows, CtxPerSlot: 2048, Slots: 2, GuaranteeCells: 256}
	specB := RunnerSpec{ModelDigest: digestB, RowBytes: rows, CtxPerSlot: 2048, Slots: 2, GuaranteeCells: 256}
	envA, err := o.RunnerEnv(ctx, specA)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		kvcached.EnvOllamaSocket: socket,
		EnvSessionName:           digestA,
		EnvSessionLabels:         LabelModelDigest + "=" + digestA,
		EnvGuaranteed:            strconv.Itoa(2 * 256 * 1024), // 256 cells x 1 KiB x K,V = 512 KiB
		EnvMaxBytes:              strconv.Itoa(2 * 2 * 2048 * 1024),
	}
	for _, kv := range envA {
		k, v, _ := strings.Cut(kv, "=")
		if want[k] != v {
			t.Errorf("RunnerEnv: %s=%s, want %q", k, v, want[k])
		}
		delete(want, k)
	}
	if len(want) != 0 {
		t.Fatalf("RunnerEnv misses %v", want)
	}
	envB, _ := o.RunnerEnv(ctx, specB)

	a := startFakeRunner(t, envA, 40) // 2.5 MiB of the 4 MiB budget
	// a snapshot that does not know a runner yet is not trusted, however
	// young: Usage takes a new one (a runner right after its load)
	maxAge := o.MaxAge
	o.MaxAge = time.Hour
	if u, ok := o.Usage(ctx, Runner{PID: a.pid}); !ok || u.HeldBytes != 40*page {
		t.Fatalf("usage of a runner newer than the snapshot: %+v %v", u, ok)
	}
	b := startFakeRunner(t, envB, 12)
	// UsageNow reads the books now (ollama ps): b's pages at once
	if u, ok := o.UsageNow(ctx, Runner{PID: b.pid}); !ok || u.HeldBytes != 12*page {
		t.Fatalf("UsageNow: %+v %v", u, ok)
	}
	o.MaxAge = maxAge
	st, _ = o.Stats(ctx, true)
	if len(st.Sessions) != 3 || st.Sessions[0].Name != "ollama-scheduler" {
		t.Fatalf("a non-admin session sees itself first, then its uid's sessions: %+v", st.Sessions)
	}
	uA, ok := o.Usage(ctx, Runner{ModelDigest: digestA, PID: a.pid})
	if !ok || uA.HeldBytes != 40*page || uA.HeldBytesByDevice["HOST-0"] != 40*page || uA.GuaranteedBytes != 512<<10 ||
		len(uA.Sessions) != 1 || uA.Sessions[0].ID != a.id || uA.Sessions[0].Labels[LabelModelDigest] != digestA {
		t.Fatalf("usage A: %+v %v", uA, ok)
	}
	uB, ok := o.Usage(ctx, Runner{ModelDigest: digestB}) // by digest alone
	if !ok || uB.HeldBytes != 12*page {
		t.Fatalf("usage B: %+v %v", uB, ok)
	}
	// Limits stay admin-only.
	g := uint64(0)
	if _, err := o.s.SetLimits(ctx, a.id, kvcached.Limits{GuaranteedBytes: &g}); !errors.Is(err, kvcached.ErrPermissionDenied) {
		t.Fatalf("SetLimits without admin: %v", err)
	}
	// A third runner guaranteed 1 MiB does not fit in the 0.75 MiB left...
	need := uint64(1 << 20)
	f, err := o.Fits(ctx, need, "")
	if err != nil || f.Fits || f.Unheld != 12*page || f.Guaranteed != 2*(512<<10) {
		t.Fatalf("fit before shrinking: %+v %v", f, err)
	}
	// ...until the idle runner A gives back what it holds above its guarantee.
	res, err := o.ShrinkIdle(ctx, []Runner{{ModelDigest: digestA, PID: a.pid}}, need, "", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if res.Asked != 1 || res.Pages != 32 || res.Freed != 32*page || !res.Fit.Fits {
		st, _ := o.Stats(ctx, true)
		t.Fatalf("shrink: %+v\n%+v\n%+v", res, st.Devices, st.Sessions)
	}
	t.Logf("idle runner shrank in %v", res.Elapsed)
	uA, _ = o.Usage(ctx, Runner{ModelDigest: digestA, PID: a.pid})
	if uA.HeldBytes != 512<<10 {
		t.Fatalf("A after shrinking holds %d, want its guarantee", uA.HeldBytes)
	}
	// A runner at its guarantee is not asked again.
	res, err = o.ShrinkIdle(ctx, []Runner{{ModelDigest: digestA, PID: a.pid}}, 100<<20, "", time.Second)
	if err != nil || res.Asked != 0 || res.Fit.Fits {
		t.Fatalf("second shrink: %+v %v", res, err)
	}
	// A runner that exits gives everything back; the handle's next read shows it.
	b.cmd.Process.Kill()
	b.cmd.Wait()
	testdaemon.WaitFor(t, 2*time.Second, "B's pages back after SIGKILL", func() (bool, string) {
		u, ok := o.Usage(ctx, Runner{ModelDigest: digestB, PID: b.pid})
		return !ok, fmt.Sprintf("%+v", u)
	})
}

// The daemon going away and coming back: reads say ok=false meanwhile
// (Ollama keeps its own numbers), and the handle reconnects by itself.
func TestOllamaHandleSurvivesDaemonRestart(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvcgo-restart-")
	if err != nil {
		t.Fatal(err)
	}
	d := rootDaemonForNobody(t, dir, "--memory-limit", "4MiB", "--page-size", "64KiB")
	o := New(d.Socket, nil)
	o.RetryInterval = 100 * time.Millisecond
	o.MaxAge = 0 // every read asks the daemon
	defer o.Close()
	ctx := testdaemon.Ctx(t)
	if _, err := o.Stats(ctx, true); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	os.Remove(d.Socket)
	os.Remove(d.Socket + ".fd")
	if _, ok := o.Usage(ctx, Runner{PID: os.Getpid()}); ok {
		t.Fatal("usage while the daemon is down")
	}
	if _, err := o.Fits(ctx, 1, ""); err == nil {
		t.Fatal("fit while the daemon is down")
	}
	rootDaemonForNobody(t, d.Dir, "--memory-limit", "4MiB", "--page-size", "64KiB")
	testdaemon.WaitFor(t, 5*time.Second, "handle reconnected", func() (bool, string) {
		f, err := o.Fits(ctx, 1, "")
		return err == nil && f.Fits, fmt.Sprint(f, err)
	})
}

// DigestUsage and ShrinkRunner through an admin session (this process runs
// as the daemon's uid): two runners of one model found by their digest
// (name or label), both asked to shrink to their guarantee, their pages
// back in the books.
func TestDigestUsageAndShrinkRunner(t *testing.T) {
	d, err := testdaemon.Start("host", nil, "--memory-limit", "4MiB", "--page-size", "64KiB", "--reclaim-timeout-ms", "3000")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Stop)
	d.LogOnFailure(t)
	const page = 64 << 10
	ctx := testdaemon.Ctx(t)
	c, err := kvcached.Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "ollama-scheduler")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	digest := "sha256:" + strings.Repeat("c", 64)
	env, err := ChildEnv(RunnerConfig{Socket: d.Socket, ModelDigest: digest, GuaranteedBytes: 4 * page})
	if err != nil {
		t.Fatal(err)
	}
	startFakeRunner(t, env, 10)
	startFakeRunner(t, env, 6)
	other, err := ChildEnv(RunnerConfig{Socket: d.Socket, ModelDigest: "sha256:" + strings.Repeat("d", 64)})
	if err != nil {
		t.Fatal(err)
	}
	startFakeRunner(t, other, 3)
	u, err := DigestUsage(ctx, s, digest)
	if err != nil || len(u.Sessions) != 2 || u.HeldBytes != 16*page || u.PagesHeld != 16 || u.GuaranteedBytes != 8*page ||
		u.HeldBytesByDevice["HOST-0"] != 16*page {
		t.Fatalf("usage: %+v %v", u, err)
	}
	pages, err := ShrinkRunner(ctx, s, digest, 0, 3*time.Second)
	if err != nil || pages != (10-4)+(6-4) {
		t.Fatalf("ShrinkRunner asked for %d pages (%v), want 8 (down to the guarantees)", pages, err)
	}
	testdaemon.WaitFor(t, 5*time.Second, "both runners at their guarantee", func() (bool, string) {
		u, err := DigestUsage(ctx, s, digest)
		return err == nil && u.HeldBytes == 8*page, fmt.Sprintf("%+v %v", u, err)
	})
	if u, err := DigestUsage(ctx, s, "sha256:"+strings.Repeat("d", 64)); err != nil || u.HeldBytes != 3*page {
		t.Fatalf("the other model must not be asked: %+v %v", u, err)
	}
	if pages, err := ShrinkRunner(ctx, s, "sha256:"+strings.Repeat("e", 64), 0, time.Second); err != nil || pages != 0 {
		t.Fatalf("ShrinkRunner of a model without runners: %d %v", pages, err)
	}
}
