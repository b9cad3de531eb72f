package kvcached

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// The integration tests run against a real kvcached-serve that they start:
// one host-backend daemon and one CUDA-backend daemon on the test driver,
// each started on first use and stopped by TestMain. Nothing is skipped:
// a missing daemon or test driver fails the tests with a message saying
// what to run.

var repoRoot = testdaemon.RepoRoot

type daemon = testdaemon.Daemon

var (
	daemonsMu sync.Mutex
	daemons   = map[string]*daemon{}
	// Set by TestMain before any test runs: the CUDA test driver's state is
	// one simulated machine for the daemon and this process alike.
	cudaState string
	// Set by TestMain: the test driver's live call counters
	// (KVCACHED_TESTDRV_CALLS), one file per process (driverCalls).
	cudaCalls string
)

var (
	testDriver    = testdaemon.TestDriver
	startDaemon   = testdaemon.Start
	startDaemonIn = testdaemon.StartIn
)

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
		case <-d.Exited:
			t.Fatalf("the %s daemon died:\n%s", key, d.Log.String())
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
	if os.Getenv(keptRollbackEnv) != "" {
		os.Exit(keptRollbackMain())
	}
	if os.Getenv(unmapRunsEnv) != "" {
		os.Exit(unmapRunsMain())
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
		if cudaCalls, err = os.MkdirTemp("", "kvcgo-cuda-calls-"); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		os.Setenv("KVCACHED_TESTDRV_CALLS", cudaCalls)
	}
	code := m.Run()
	for _, d := range daemons {
		d.Stop()
	}
	if cudaState != "" {
		os.RemoveAll(cudaState)
		os.RemoveAll(cudaCalls)
	}
	os.Exit(code)
}

// connect dials a backend's daemon; the client is closed at cleanup.
func connect(t *testing.T, backend string) (*daemon, *Client) {
	t.Helper()
	d := sharedDaemon(t, backend)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return d, c
}

func testCtx(t *testing.T) context.Context { return testdaemon.Ctx(t) }

// checkGoroutines fails the test if goroutines started during it are
// still running after it (no goroutine leaks).
func checkGoroutines(t *testing.T) { t.Helper(); testdaemon.CheckGoroutines(t) }

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	return testdaemon.WaitFor(t, d, what, cond)
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
