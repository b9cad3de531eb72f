package kvcached

import (
	"bytes"
	"fmt"
	"slices"
	"testing"
	"time"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Kept handles against a real daemon on the CUDA test driver
// (docs/protocol.md, "Kept handles"): the daemon offers them, a Region's
// Unmap frees with keep, and the pages that come back to the same session
// are mapped from their kept handles: no cuMemImportFromShareableHandle
// (the test driver's live call counters of this process).

// regionPageIDs is the ids of a region's mapped pages in use (not
// standby), in slot order.
func regionPageIDs(r *Region) []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ids []uint64
	for _, s := range r.slots {
		if s.live() {
			ids = append(ids, s.id)
		}
	}
	return ids
}

func TestKeptHandlesAgainstDaemon(t *testing.T) {
	// A daemon of its own: no pages of earlier tests in its pool.
	d := sharedDaemonWith(t, "cuda-kept", "cuda")
	checkGoroutines(t)
	d.LogOnFailure(t)
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-kept")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	if !s.Info().FDChannelKeepHandles {
		t.Fatalf("the daemon (version %q) does not offer kept handles (GetInfo().fd_channel_keep_handles)", s.Info().Version)
	}
	ps := s.Info().Devices[0].PageSize
	const n = 4
	start := driverCalls(t)
	r, err := s.NewRegion(ctx, n*ps)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Map(ctx, 0, n*ps); err != nil {
		t.Fatal(err)
	}
	if d := callDelta(driverCalls(t), start); d["cuMemImportFromShareableHandle"] != n || d["cuMemRelease"] != 0 {
		t.Fatalf("first map: calls %v; want %d imports, kept (no release)", d, n)
	}
	if s.kept.count() != n {
		t.Fatalf("%d handles kept, want %d", s.kept.count(), n)
	}
	first := regionPageIDs(r)
	if _, err := r.WriteAt([]byte("first loan"), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Unmap(ctx, 0, n*ps); err != nil { // FREE with keep
		t.Fatal(err)
	}
	own, err := s.Own(ctx)
	if err != nil || own.PagesHeld != 0 {
		t.Fatalf("after Unmap the daemon says %d pages held (%v)", own.PagesHeld, err)
	}
	// Once zeroed, the uid's most recent pages are the first it gets back
	// (while they are being zeroed an Allocate takes ready pages instead).
	waitFor(t, 10*time.Second, "the freed pages zeroed", func() (bool, string) {
		st, err := c.rpc.GetStats(ctx, &pb.GetStatsRequest{})
		if err != nil {
			return false, err.Error()
		}
		z := st.GetTotal().GetPagesZeroing()
		return z == 0, fmt.Sprintf("%d pages being zeroed", z)
	})

	before := driverCalls(t)
	if err := r.Map(ctx, 0, n*ps); err != nil {
		t.Fatal(err)
	}
	again := regionPageIDs(r)
	if !slices.Equal(slices.Sorted(slices.Values(again)), slices.Sorted(slices.Values(first))) {
		t.Fatalf("pages %v came back, not %v: the test expects the session's own pages back (one uid, last in first out)", again, first)
	}
	dd := callDelta(driverCalls(t), before)
	if dd["cuMemImportFromShareableHandle"] != 0 || dd["cuMemRelease"] != 0 || dd["cuMemMap"] != n || dd["cuMemSetAccess"] != 1 {
		t.Fatalf("the pages that came back: calls %v; want no import and no release, %d maps, one cuMemSetAccess", dd, n)
	}
	got := make([]byte, 10)
	if _, err := r.ReadAt(got, 0); err != nil || !bytes.Equal(got, make([]byte, 10)) {
		t.Fatalf("a page that came back holds %q (%v); the daemon zeroes freed pages", got, err)
	}
	if _, err := r.WriteAt([]byte("second loan"), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if s.kept.count() != n {
		t.Fatalf("%d handles kept after Region.Close, want %d", s.kept.count(), n)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// The session's end released every handle: as many releases as imports.
	if s.KeptHandles() != 0 {
		t.Fatalf("%d handles kept after Close", s.KeptHandles())
	}
	if dd := callDelta(driverCalls(t), start); dd["cuMemImportFromShareableHandle"] != n || dd["cuMemRelease"] != n {
		t.Fatalf("the whole session: calls %v; want %d imports and %d releases", dd, n, n)
	}
}

// A daemon whose pool trims idle pages at once asks for the kept handles
// first (DROP): the session's reader releases them and answers DROPPED by
// itself, the daemon then releases the pages, the session goes on.
func TestKeptHandlesDroppedByDaemon(t *testing.T) {
	d := sharedDaemonWith(t, "cuda-pool-idle-0", "cuda", "--pool-idle-seconds", "0")
	checkGoroutines(t) // (after the daemon's start: its goroutines stay)
	d.LogOnFailure(t)
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := c.OpenSession(ctx, "go-kept-dropped")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	ps := s.Info().Devices[0].PageSize
	const n = 3
	start := driverCalls(t)
	r, err := s.NewRegion(ctx, n*ps)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(ctx)
	if err := r.Map(ctx, 0, n*ps); err != nil {
		t.Fatal(err)
	}
	if err := r.Unmap(ctx, 0, n*ps); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the DROP answered (every handle released)", func() (bool, string) {
		k := s.kept.count()
		return k == 0, fmt.Sprintf("%d kept", k)
	})
	waitFor(t, 10*time.Second, "the pages released after DROPPED", func() (bool, string) {
		st, err := c.Stats(ctx)
		if err != nil {
			return false, err.Error()
		}
		return st.Total.PagesPooled == 0, fmt.Sprintf("%d pooled", st.Total.PagesPooled)
	})
	if dd := callDelta(driverCalls(t), start); dd["cuMemImportFromShareableHandle"] != n || dd["cuMemRelease"] != n {
		t.Fatalf("calls %v; want %d imports, %d releases (the DROP's)", dd, n, n)
	}
	if err := s.Err(); err != nil {
		t.Fatalf("the session ended: %v", err)
	}
	// A new page: imported, and kept again.
	if err := r.Map(ctx, 0, ps); err != nil {
		t.Fatal(err)
	}
	if s.kept.count() != 1 {
		t.Fatalf("%d kept after a new map, want 1", s.kept.count())
	}
}
