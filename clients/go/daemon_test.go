package kvcached

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The integration tests run against a real kvcached-serve that they start:
// one host-backend daemon and one CUDA-backend daemon on the test driver,
// each started on first use and stopped by TestMain. Nothing is skipped:
// a missing daemon or test driver fails the tests with a message saying
// what to run.

var repoRoot = func() string {
	if r := os.Getenv("KVCACHED_REPO"); r != "" {
		return r
	}
	r, _ := filepath.Abs("../..")
	return r
}()

type daemon struct {
	backend string
	dir     string
	socket  string
	env     []string
	cmd     *exec.Cmd
	log     *lockedBuffer
	exited  chan struct{}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var (
	daemonsMu sync.Mutex
	daemons   = map[string]*daemon{}
	// Set by TestMain before any test runs: the CUDA test driver's state is
	// one simulated machine for the daemon and this process alike.
	cudaState string
)

func serveBinary() (string, error) {
	p := filepath.Join(repoRoot, ".venv", "bin", "kvcached-serve")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not found: run scripts/setup.sh (it creates .venv with the daemon)", p)
	}
	return p, nil
}

// testDriver is the libcuda of the CUDA tests: $KVCACHED_TEST_LIBCUDA (another
// driver, e.g. the real one on a GPU host), else the project's test driver.
func testDriver() (string, error) {
	if p := os.Getenv("KVCACHED_TEST_LIBCUDA"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("KVCACHED_TEST_LIBCUDA=%s: %v", p, err)
		}
		return p, nil
	}
	p := filepath.Join(repoRoot, "build", "testdriver", "libcuda.so.1")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not found: run scripts/build-testdriver.sh", p)
	}
	return p, nil
}

// startDaemon starts kvcached-serve and waits until it is healthy.
func startDaemon(backend string, extraEnv []string, args ...string) (*daemon, error) {
	if _, err := serveBinary(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvcgo-")
	if err != nil {
		return nil, err
	}
	return startDaemonIn(dir, backend, extraEnv, args...)
}

// startDaemonIn starts kvcached-serve with its socket in dir (a restart on
// the same socket after kill); stop removes dir.
func startDaemonIn(dir, backend string, extraEnv []string, args ...string) (*daemon, error) {
	bin, err := serveBinary()
	if err != nil {
		return nil, err
	}
	d := &daemon{backend: backend, dir: dir, socket: filepath.Join(dir, "k.sock"), log: &lockedBuffer{}, exited: make(chan struct{})}
	d.env = append(os.Environ(), extraEnv...)
	argv := append([]string{"--socket", d.socket, "--backend", backend, "--memory-limit", "256MiB",
		"--reclaim-timeout-ms", "1500"}, args...)
	d.cmd = exec.Command(bin, argv...)
	d.cmd.Env = d.env
	d.cmd.Stdout = d.log
	d.cmd.Stderr = d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := d.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = d.cmd.Wait(); close(d.exited) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-d.exited:
			return nil, fmt.Errorf("kvcached-serve exited during start-up:\n%s", d.log.String())
		default:
		}
		if _, err := os.Stat(d.socket); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			c, err := Dial(ctx, d.socket)
			if err == nil {
				err = c.Healthy(ctx)
				c.Close()
			}
			cancel()
			if err == nil {
				return d, nil
			}
		}
		if time.Now().After(deadline) {
			d.stop()
			return nil, fmt.Errorf("kvcached-serve not healthy after 30 s:\n%s", d.log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// kill SIGKILLs the daemon and waits for it; its directory stays.
func (d *daemon) kill() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
}

func (d *daemon) stop() {
	if d.cmd.Process != nil {
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-time.After(10 * time.Second):
			_ = d.cmd.Process.Kill()
			<-d.exited
		}
	}
	os.RemoveAll(d.dir)
}

// sharedDaemon returns the daemon of a backend, starting it on first use.
func sharedDaemon(t *testing.T, backend string) *daemon {
	t.Helper()
	return sharedDaemonWith(t, backend, backend)
}

// sharedDaemonWith returns the daemon named key (a backend started with
// args), starting it on first use.
func sharedDaemonWith(t *testing.T, key, backend string, args ...string) *daemon {
	t.Helper()
	daemonsMu.Lock()
	defer daemonsMu.Unlock()
	if d := daemons[key]; d != nil {
		select {
		case <-d.exited:
			t.Fatalf("the %s daemon died:\n%s", key, d.log.String())
		default:
		}
		return d
	}
	d, err := startDaemon(backend, backendEnv(t, backend), args...)
	if err != nil {
		t.Fatal(err)
	}
	daemons[key] = d
	return d
}

// backendEnv is the extra environment of a daemon of backend: the CUDA
// test driver, sharing this process's simulated machine.
func backendEnv(t *testing.T, backend string) []string {
	t.Helper()
	if backend != "cuda" {
		return nil
	}
	drv, err := testDriver()
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv(EnvLibCUDA) != drv {
		t.Fatalf("%s must be %s for the whole test process (TestMain sets it)", EnvLibCUDA, drv)
	}
	return []string{EnvLibCUDA + "=" + drv, "KVCACHED_TESTDRV_STATE=" + cudaState}
}

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	if os.Getenv(runnerHelperEnv) != "" {
		os.Exit(runnerHelperMain())
	}
	if os.Getenv(asNobodyEnv) != "" {
		if err := dropPrivileges(); err != nil {
			fmt.Fprintln(os.Stderr, "dropping privileges:", err)
			os.Exit(2)
		}
	}
	// The CUDA driver is loaded once per process, so its environment is
	// fixed here for every test (and inherited by helper processes).
	if drv, err := testDriver(); err == nil {
		dir, err := os.MkdirTemp("", "kvcgo-cuda-state-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		cudaState = dir
		os.Setenv(EnvLibCUDA, drv)
		os.Setenv("KVCACHED_TESTDRV_STATE", dir)
	}
	code := m.Run()
	for _, d := range daemons {
		d.stop()
	}
	if cudaState != "" {
		os.RemoveAll(cudaState)
	}
	os.Exit(code)
}

// connect dials a backend's daemon; the client is closed at cleanup.
func connect(t *testing.T, backend string) (*daemon, *Client) {
	t.Helper()
	d := sharedDaemon(t, backend)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, d.socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return d, c
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// checkGoroutines fails the test if goroutines started during it are
// still running after it (no goroutine leaks).
func checkGoroutines(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(3 * time.Second)
		for runtime.NumGoroutine() > before {
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				n := runtime.Stack(buf, true)
				t.Errorf("goroutine leak: %d before, %d after\n%s", before, runtime.NumGoroutine(), buf[:n])
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ok, state := cond()
		if ok {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v (%s)", what, d, state)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func pattern(seed, n int) []byte {
	b := make([]byte, n)
	x := uint32(seed*2654435761 + 1)
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
	return b
}

var _ = io.EOF
var _ = strings.TrimSpace
