// Package testdaemon starts real kvcached-serve daemons for the tests of
// the Go client's packages (kvcached and ollama): the venv's
// kvcached-serve, on a socket in a directory of its own, healthy before it
// is returned. Nothing is skipped: a missing daemon or test driver is an
// error saying what to run. It does not import the client (the kvcached
// package's own tests use it), so it checks health with the gRPC health
// service directly.
package testdaemon

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// RepoRoot is the repository's root: $KVCACHED_REPO, else the nearest
// directory above the working directory (a package's, under go test)
// that holds clients/go/go.mod.
var RepoRoot = func() string {
	if r := os.Getenv("KVCACHED_REPO"); r != "" {
		return r
	}
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "clients", "go", "go.mod")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return dir
		}
	}
}()

// Daemon is one kvcached-serve the tests started.
type Daemon struct {
	Backend string
	Dir     string // holds the sockets; Stop removes it
	Socket  string
	Env     []string // the daemon's environment (helper processes reuse it)
	Cmd     *exec.Cmd
	Log     *LockedBuffer // stdout and stderr
	Exited  chan struct{} // closed when the process has exited
}

// LockedBuffer is a bytes.Buffer safe for a process's output and a reader.
type LockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *LockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// ServeBinary is the venv's kvcached-serve.
func ServeBinary() (string, error) {
	p := filepath.Join(RepoRoot, ".venv", "bin", "kvcached-serve")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not found: run scripts/setup.sh (it creates .venv with the daemon)", p)
	}
	return p, nil
}

// TestDriver is the libcuda of the CUDA tests: $KVCACHED_TEST_LIBCUDA
// (another driver, e.g. the real one on a GPU host), else the project's
// test driver.
func TestDriver() (string, error) {
	if p := os.Getenv("KVCACHED_TEST_LIBCUDA"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("KVCACHED_TEST_LIBCUDA=%s: %v", p, err)
		}
		return p, nil
	}
	p := filepath.Join(RepoRoot, "build", "testdriver", "libcuda.so.1")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not found: run scripts/build-testdriver.sh", p)
	}
	return p, nil
}

// Start starts kvcached-serve in a new directory and waits until it is
// healthy.
func Start(backend string, extraEnv []string, args ...string) (*Daemon, error) {
	if _, err := ServeBinary(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvcgo-")
	if err != nil {
		return nil, err
	}
	return StartIn(dir, backend, extraEnv, args...)
}

// StartIn starts kvcached-serve with its socket in dir (a restart on the
// same socket after Kill); Stop removes dir.
func StartIn(dir, backend string, extraEnv []string, args ...string) (*Daemon, error) {
	bin, err := ServeBinary()
	if err != nil {
		return nil, err
	}
	d := &Daemon{Backend: backend, Dir: dir, Socket: filepath.Join(dir, "k.sock"), Log: &LockedBuffer{}, Exited: make(chan struct{})}
	d.Env = append(os.Environ(), extraEnv...)
	argv := append([]string{"--socket", d.Socket, "--backend", backend, "--memory-limit", "256MiB",
		"--reclaim-timeout-ms", "1500"}, args...)
	d.Cmd = exec.Command(bin, argv...)
	d.Cmd.Env = d.Env
	d.Cmd.Stdout = d.Log
	d.Cmd.Stderr = d.Log
	d.Cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := d.Cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = d.Cmd.Wait(); close(d.Exited) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-d.Exited:
			return nil, fmt.Errorf("kvcached-serve exited during start-up:\n%s", d.Log.String())
		default:
		}
		if _, err := os.Stat(d.Socket); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			err = Healthy(ctx, d.Socket)
			cancel()
			if err == nil {
				return d, nil
			}
		}
		if time.Now().After(deadline) {
			d.Stop()
			return nil, fmt.Errorf("kvcached-serve not healthy after 30 s:\n%s", d.Log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Healthy asks the daemon's gRPC health service at socket whether
// kvcached.v1.KVCached is SERVING.
func Healthy(ctx context.Context, socket string) error {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "kvcached.v1.KVCached"})
	if err != nil {
		return err
	}
	if r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("daemon reports %v", r.GetStatus())
	}
	return nil
}

// Kill SIGKILLs the daemon and waits for it; its directory stays.
func (d *Daemon) Kill() {
	_ = d.Cmd.Process.Signal(syscall.SIGKILL)
	<-d.Exited
}

// Stop SIGTERMs the daemon (SIGKILL after 10 s), waits, removes its
// directory.
// LogOnFailure has t's log show the daemon's output when t fails.
func (d *Daemon) LogOnFailure(t testing.TB) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kvcached-serve's output (%s):\n%s", d.Socket, d.Log.String())
		}
	})
}

func (d *Daemon) Stop() {
	if d.Cmd.Process != nil {
		_ = d.Cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-d.Exited:
		case <-time.After(10 * time.Second):
			_ = d.Cmd.Process.Kill()
			<-d.Exited
		}
	}
	os.RemoveAll(d.Dir)
}

// Ctx is a context of 30 s, cancelled at the test's cleanup.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// CheckGoroutines fails the test if goroutines started during it are
// still running after it (no goroutine leaks).
func CheckGoroutines(t testing.TB) {
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

// WaitFor polls cond until it holds or d passes.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() (bool, string)) time.Duration {
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
