package kvcached

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Unmapping runs of adjacent pages on CUDA (the test driver's live call
// counters of this process): a Region gives back each run of adjacent
// pages with one cuMemUnmap over the run, whatever gives them back
// (Unmap, Trim, ReleasePages, Close); the failure cases run in child
// processes whose cuMemUnmap calls are refused (KVCACHED_TESTDRV_FAIL).

func TestUnmapRunsOnCUDA(t *testing.T) {
	_, c := connect(t, "cuda")
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-unmap-runs")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, 8*ps)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(ctx)
	unmaps := func(what string, want uint64, do func() error) {
		t.Helper()
		before := driverCalls(t)
		if err := do(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if d := callDelta(driverCalls(t), before); d["cuMemUnmap"] != want {
			t.Fatalf("%s: %d cuMemUnmap, want %d (calls %v)", what, d["cuMemUnmap"], want, d)
		}
	}
	mapAll := func() error { return r.Map(ctx, 0, 8*ps) }
	if err := mapAll(); err != nil {
		t.Fatal(err)
	}
	unmaps("Unmap of 3 adjacent pages", 1, func() error { return r.Unmap(ctx, ps, 3*ps) })
	if r.MappedBytes() != 5*ps || r.IsMapped(ps, ps) || !r.IsMapped(4*ps, ps) {
		t.Fatalf("after Unmap: %d bytes mapped", r.MappedBytes())
	}
	// Pages 0 and 4-7 mapped: Trim(0) is two runs, two calls.
	unmaps("Trim over two runs", 2, func() error { return r.Trim(ctx, 0) })
	if err := mapAll(); err != nil {
		t.Fatal(err)
	}
	unmaps("ReleasePages(3)", 1, func() error {
		n, err := r.ReleasePages(ctx, 3, 0)
		if err == nil && n != 3 {
			err = fmt.Errorf("%d pages given back, want 3", n)
		}
		return err
	})
	unmaps("Close of 5 pages", 1, func() error { return r.Close(ctx) })
	own, err := s.Own(ctx)
	if err != nil || own.PagesHeld != 0 {
		t.Fatalf("after Close the daemon says %d pages held (%v)", own.PagesHeld, err)
	}
}

// unmapRunsEnv makes the test binary run unmapRunsMain (a process of its
// own: the test driver's failure injection counts calls from load).
const unmapRunsEnv = "KVCACHED_GO_TEST_UNMAP_RUNS"

// A run whose cuMemUnmap the driver refuses is unmapped page by page and
// freed; a page whose own cuMemUnmap is refused too stays mapped and held
// (not freed), the error returned. The children's totals of cuMemUnmap
// (their live call counters outlive them) show each step's calls.
func TestUnmapRunsRefusedOnCUDA(t *testing.T) {
	d, _ := connect(t, "cuda")
	for _, c := range []struct {
		mode, fail string
		unmaps     uint64
	}{
		// the run of pages 0-2 (1, refused), pages 0, 1, 2 (2-4), Close: page 3 (5)
		{"refused", "cuMemUnmap:1", 5},
		// the run (1, refused), page 0 (2), page 1 (3, refused), page 2 (4);
		// Close: pages 1 and 3, not adjacent (5, 6)
		{"stuck", "cuMemUnmap:1,cuMemUnmap:3", 6},
	} {
		t.Run(c.mode, func(t *testing.T) {
			calls := t.TempDir()
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(append([]string{}, d.Env...), unmapRunsEnv+"="+c.mode, EnvOllamaSocket+"="+d.Socket,
				"KVCACHED_TESTDRV_FAIL="+c.fail, "KVCACHED_TESTDRV_CALLS="+calls)
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "OK") {
				t.Fatalf("child: %v\n%s", err, out)
			}
			if got := driverCallsOf(t, calls, cmd.Process.Pid)["cuMemUnmap"]; got != c.unmaps {
				t.Fatalf("the child called cuMemUnmap %d times, want %d\n%s", got, c.unmaps, out)
			}
		})
	}
}

// unmapRunsMain is the child of TestUnmapRunsRefusedOnCUDA: 4 pages
// mapped, pages 0-2 unmapped (one run), then the region closed.
func unmapRunsMain() int {
	mode := os.Getenv(unmapRunsEnv)
	fail := func(format string, a ...any) int {
		fmt.Printf("ERROR "+format+"\n", a...)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := FromEnv(ctx)
	if err != nil {
		return fail("%v", err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-unmap-runs-"+mode)
	if err != nil {
		return fail("%v", err)
	}
	defer s.Close(ctx)
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, 4*ps)
	if err != nil {
		return fail("%v", err)
	}
	if err := r.Map(ctx, 0, 4*ps); err != nil {
		return fail("%v", err)
	}
	held := func() uint64 {
		own, err := s.Own(ctx)
		if err != nil {
			return ^uint64(0)
		}
		return own.PagesHeld
	}
	err = r.Unmap(ctx, 0, 3*ps)
	switch mode {
	case "refused": // page by page: every page unmapped and freed
		if err != nil {
			return fail("Unmap with the run refused: %v", err)
		}
		if r.MappedBytes() != ps || !r.IsMapped(3*ps, ps) || held() != 1 {
			return fail("after Unmap: %d bytes mapped, %d pages held; want page 3 only", r.MappedBytes(), held())
		}
	case "stuck": // page 1 cannot be unmapped: mapped, held, not freed
		if !errors.Is(err, ErrMapping) || !strings.Contains(err.Error(), "cuMemUnmap") {
			return fail("Unmap with page 1 refused: %v, want ErrMapping naming cuMemUnmap", err)
		}
		if r.MappedBytes() != 2*ps || !r.IsMapped(ps, ps) || r.IsMapped(0, ps) || r.IsMapped(2*ps, ps) || held() != 2 {
			return fail("after Unmap: %d bytes mapped, %d pages held; want pages 1 and 3", r.MappedBytes(), held())
		}
	default:
		return fail("unknown mode %q", mode)
	}
	if err := r.Close(ctx); err != nil {
		return fail("Close: %v", err)
	}
	if held() != 0 {
		return fail("%d pages held after Close", held())
	}
	fmt.Println("OK")
	return 0
}
