package kvcached

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The CUDA mapper's cache of kept handles, on the CUDA test driver, with
// pages of the CUDA daemon (the cache is driven directly here: whether
// the daemon offers keep does not matter to it). The driver's live call
// counters show what each map costs: a page whose handle is kept is mapped
// without cuMemImportFromShareableHandle and without cuMemRelease.
func TestKeptHandleCache(t *testing.T) {
	_, c := connect(t, "cuda")
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-kept-handles")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	dev := s.Info().Devices[0]
	ps := dev.PageSize
	a, err := s.Allocate(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ids := a.IDs()

	k := newKeptHandles(true, 2, nil) // room for two of the three
	mm, err := newCUDAMapper(dev, k)
	if err != nil {
		t.Fatal(err)
	}
	m := mm.(*cudaMapper)
	defer m.close()
	base, err := m.reserve(3 * ps)
	if err != nil {
		t.Fatal(err)
	}
	defer m.release(base, 3*ps)
	addr := func(i int) uintptr { return base + uintptr(uint64(i)*ps) }
	// run dups the descriptors of pages idx (mapRun closes what it is
	// given), as the pages of generation gen.
	run := func(gen uint64, idx ...int) pageRun {
		r := pageRun{gen: gen}
		for _, i := range idx {
			fd, err := unix.FcntlInt(a.Pages[i].File.Fd(), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			r.files = append(r.files, os.NewFile(uintptr(fd), "page"))
			r.ids = append(r.ids, ids[i])
		}
		return r
	}
	unmapAll := func(n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			if err := m.unmap(addr(i), ps); err != nil {
				t.Fatal(err)
			}
		}
	}
	// mapped maps r at page 0 and checks the calls it made.
	mapped := func(what string, r pageRun, imports, releases uint64, kept int) {
		t.Helper()
		before := driverCalls(t)
		if err := m.mapRun(addr(0), r, ps); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		d := callDelta(driverCalls(t), before)
		n := uint64(len(r.files))
		if d["cuMemImportFromShareableHandle"] != imports || d["cuMemRelease"] != releases ||
			d["cuMemMap"] != n || d["cuMemSetAccess"] != 1 {
			t.Fatalf("%s: driver calls %v; want %d imports, %d releases, %d maps, 1 cuMemSetAccess", what, d, imports, releases, n)
		}
		if got := k.count(); got != kept {
			t.Fatalf("%s: %d handles kept, want %d", what, got, kept)
		}
	}
	start := driverCalls(t)

	// A miss imports; the first two handles are kept, the third (the cache
	// is full) released after mapping, as without a cache.
	mapped("first map", run(0, 0, 1, 2), 3, 1, 2)
	for i := 0; i < 3; i++ {
		if err := m.write(addr(i), pattern(40+i, int(ps))); err != nil {
			t.Fatal(err)
		}
	}
	if !k.Keeps(ids[:1]) || !k.Keeps(ids[1:2]) || k.Keeps(ids[2:]) {
		t.Fatalf("kept: %v %v %v; want the first two only", k.Keeps(ids[:1]), k.Keeps(ids[1:2]), k.Keeps(ids[2:]))
	}
	unmapAll(3)

	// A hit: the kept handles are mapped (the descriptor is closed, no
	// import, no release), the page full: the third is imported again.
	mapped("second map", run(0, 0, 1, 2), 1, 1, 2)
	for i := 0; i < 3; i++ {
		got := make([]byte, ps)
		if err := m.read(addr(i), got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, pattern(40+i, int(ps))) {
			t.Fatalf("page %d mapped again does not hold its bytes", i)
		}
	}
	unmapAll(3)

	// A DROP releases the handles named (99 is nothing to the cache); the
	// page is imported next time, and kept again.
	before := driverCalls(t)
	k.Drop([]uint64{ids[0], 99})
	if d := callDelta(driverCalls(t), before); d["cuMemRelease"] != 1 || k.count() != 1 || k.Keeps(ids[:1]) {
		t.Fatalf("after DROP: calls %v, %d kept", d, k.count())
	}
	mapped("map after DROP", run(0, 0), 1, 0, 2)
	unmapAll(1)

	// A resume releases every handle; pages of the old channel are then
	// neither mapped from a handle nor kept, the new channel's are.
	before = driverCalls(t)
	k.Reset(1, false)
	if d := callDelta(driverCalls(t), before); d["cuMemRelease"] != 2 || k.count() != 0 {
		t.Fatalf("after a resume: calls %v, %d kept", d, k.count())
	}
	mapped("old channel's page after a resume", run(0, 0), 1, 1, 0)
	unmapAll(1)
	mapped("new channel's pages", run(1, 0, 1), 2, 0, 2)
	unmapAll(2)
	mapped("new channel's pages again", run(1, 0, 1), 0, 0, 2)
	unmapAll(2)

	// The session's end releases every handle and keeps nothing after.
	before = driverCalls(t)
	k.Reset(1, true)
	if d := callDelta(driverCalls(t), before); d["cuMemRelease"] != 2 || k.count() != 0 {
		t.Fatalf("after the session's end: calls %v, %d kept", d, k.count())
	}
	mapped("after the end", run(1, 0), 1, 1, 0)
	unmapAll(1)

	// Every handle imported was released.
	d := callDelta(driverCalls(t), start)
	if d["cuMemImportFromShareableHandle"] != d["cuMemRelease"] {
		t.Fatalf("%d imports, %d releases", d["cuMemImportFromShareableHandle"], d["cuMemRelease"])
	}
}

// KVCACHED_KEEP_HANDLES 0, or a daemon that does not offer keep: nothing
// is kept, every map imports and releases.
func TestKeptHandleCacheOff(t *testing.T) {
	_, c := connect(t, "cuda")
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-kept-handles-off")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	dev := s.Info().Devices[0]
	ps := dev.PageSize
	for _, k := range []*keptHandles{newKeptHandles(true, 0, nil), newKeptHandles(false, 8, nil)} {
		a, err := s.Allocate(ctx, 1)
		if err != nil {
			t.Fatal(err)
		}
		mm, err := newCUDAMapper(dev, k)
		if err != nil {
			t.Fatal(err)
		}
		base, err := mm.reserve(ps)
		if err != nil {
			t.Fatal(err)
		}
		before := driverCalls(t)
		f := a.Pages[0].File
		a.Pages[0].File = nil
		if err := mm.mapRun(base, pageRun{files: []*os.File{f}, ids: a.IDs()}, ps); err != nil {
			t.Fatal(err)
		}
		d := callDelta(driverCalls(t), before)
		if d["cuMemImportFromShareableHandle"] != 1 || d["cuMemRelease"] != 1 || k.count() != 0 || k.Keeps(a.IDs()) {
			t.Fatalf("limit %d, on %v: calls %v, %d kept", k.limit, k.on, d, k.count())
		}
		if err := mm.unmap(base, ps); err != nil {
			t.Fatal(err)
		}
		if err := mm.release(base, ps); err != nil {
			t.Fatal(err)
		}
		mm.close()
		if _, err := s.Free(ctx, a.IDs()); err != nil {
			t.Fatal(err)
		}
	}
}

func TestKeepLimitFromEnv(t *testing.T) {
	for v, want := range map[string]int{"": defaultKeepHandles, "0": 0, "12": 12, "-1": defaultKeepHandles, "x": defaultKeepHandles} {
		t.Run(fmt.Sprintf("%q", v), func(t *testing.T) {
			t.Setenv(EnvKeepHandles, v)
			if got := keepLimitFromEnv(slog.New(slog.DiscardHandler)); got != want {
				t.Fatalf("%s=%q: %d, want %d", EnvKeepHandles, v, got, want)
			}
		})
	}
}

// keptRollbackEnv makes the test binary run keptRollbackMain (a process of
// its own: the test driver's failure injection counts calls from load).
const keptRollbackEnv = "KVCACHED_GO_TEST_KEPT_ROLLBACK"

// A map that fails part way is all or nothing with kept handles too: the
// handles it imported to keep are released and not kept, the kept ones
// given in stay. Run in a child process whose fourth cuMemMap fails
// (KVCACHED_TESTDRV_FAIL); its driver's live call counters (they outlive
// it; a leak report would not be written: Go's os.Exit runs no C
// destructor) must show as many releases as imports and every mapping
// undone.
func TestKeptHandleCacheMapFailure(t *testing.T) {
	d, _ := connect(t, "cuda")
	calls := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append([]string{}, d.Env...), keptRollbackEnv+"=1", EnvOllamaSocket+"="+d.Socket,
		"KVCACHED_TESTDRV_FAIL=cuMemMap:4", "KVCACHED_TESTDRV_CALLS="+calls)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK") {
		t.Fatalf("child: %v\n%s", err, out)
	}
	c := driverCallsOf(t, calls, cmd.Process.Pid)
	// maps: 1 (page 0), 2-3 then 4 failing (pages 0, 1; 2 refused), 3 again: 7 calls, 6 mappings, all unmapped
	if c["cuMemImportFromShareableHandle"] != 5 || c["cuMemRelease"] != 5 || c["cuMemMap"] != 7 || c["cuMemUnmap"] != 6 {
		t.Fatalf("the child's driver calls %v; want 5 imports, 5 releases, 7 cuMemMap (one failed), 6 cuMemUnmap\n%s", c, out)
	}
}

// keptRollbackMain is the child of TestKeptHandleCacheMapFailure.
func keptRollbackMain() int {
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
	s, err := c.OpenSession(ctx, "go-kept-rollback")
	if err != nil {
		return fail("%v", err)
	}
	defer s.Close(ctx)
	dev := s.Info().Devices[0]
	ps := dev.PageSize
	a, err := s.Allocate(ctx, 3)
	if err != nil {
		return fail("%v", err)
	}
	defer a.Close()
	k := newKeptHandles(true, 8, nil)
	mm, err := newCUDAMapper(dev, k)
	if err != nil {
		return fail("%v", err)
	}
	defer mm.close()
	base, err := mm.reserve(3 * ps)
	if err != nil {
		return fail("%v", err)
	}
	defer mm.release(base, 3*ps)
	run := func(idx ...int) pageRun {
		r := pageRun{}
		for _, i := range idx {
			fd, err := unix.FcntlInt(a.Pages[i].File.Fd(), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				panic(err)
			}
			r.files = append(r.files, os.NewFile(uintptr(fd), "page"))
			r.ids = append(r.ids, a.Pages[i].ID)
		}
		return r
	}
	// Page 0 kept by a first map (cuMemMap 1), unmapped.
	if err := mm.mapRun(base, run(0), ps); err != nil {
		return fail("first map: %v", err)
	}
	if err := mm.unmap(base, ps); err != nil {
		return fail("%v", err)
	}
	// Pages 0 (kept: cuMemMap 2), 1 (imported to keep: 3) and 2 (4
	// fails): 1's new handle is released, 0's stays kept.
	var ce *Error
	if err := mm.mapRun(base, run(0, 1, 2), ps); !errors.As(err, &ce) || !errors.Is(err, ErrMapping) {
		return fail("the map with cuMemMap 4 failing: %v", err)
	}
	if k.count() != 1 || !k.Keeps(a.IDs()[:1]) {
		return fail("after the failed map %d kept; want page 0's only", k.count())
	}
	// Again: every page mapped, 1 and 2 imported and kept.
	if err := mm.mapRun(base, run(0, 1, 2), ps); err != nil {
		return fail("the map again: %v", err)
	}
	if k.count() != 3 {
		return fail("%d kept, want 3", k.count())
	}
	for i := 0; i < 3; i++ {
		if err := mm.unmap(base+uintptr(uint64(i)*ps), ps); err != nil {
			return fail("%v", err)
		}
	}
	k.Reset(0, true)
	fmt.Println("OK")
	return 0
}
