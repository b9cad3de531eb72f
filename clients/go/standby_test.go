package kvcached

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// Standby pages against a real daemon (docs/protocol.md, "Standby pages";
// tests/test_standby.py is the Python side): TrimStandby keeps the pages
// mapped and the session's (its stats show standby bytes), Map takes them
// back with no Allocate (allocations_total unchanged) and, on the CUDA test
// driver, no driver call at all; the data survives (standby pages are
// never zeroed); a plain Unmap frees standby pages; Close frees the rest.
func TestStandbyAgainstDaemon(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		d, c := connect(t, backend)
		d.LogOnFailure(t)
		ctx := testCtx(t)
		s, err := c.OpenSession(ctx, "go-standby")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		if !s.Info().FDChannelStandby {
			t.Fatalf("the daemon (version %q) does not offer standby pages (GetInfo().fd_channel_standby)", s.Info().Version)
		}
		ps := s.Info().Devices[0].PageSize
		r, err := s.NewRegion(ctx, 8*ps)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Map(ctx, 0, 4*ps); err != nil {
			t.Fatal(err)
		}
		data := pattern(42, 64)
		if _, err := r.WriteAt(data, int64(2*ps)+100); err != nil {
			t.Fatal(err)
		}
		ids := regionPageIDs(r)
		calls := func() map[string]uint64 {
			if backend != "cuda" {
				return nil
			}
			return driverCalls(t)
		}

		before := calls()
		if err := r.TrimStandby(ctx, ps); err != nil { // pages 1..3 standby
			t.Fatal(err)
		}
		if dd := callDelta(calls(), before); len(dd) != 0 {
			t.Fatalf("TrimStandby made driver calls %v; want none (the pages stay mapped)", dd)
		}
		if r.MappedBytes() != ps || r.StandbyBytes() != 3*ps || r.IsMapped(2*ps, ps) {
			t.Fatalf("after TrimStandby: %d bytes mapped, %d standby", r.MappedBytes(), r.StandbyBytes())
		}
		if _, err := r.ReadAt(make([]byte, 8), int64(2*ps)); !errors.Is(err, ErrNotMapped) {
			t.Fatalf("ReadAt of a standby page: %v", err)
		}
		me, err := s.Own(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if me.PagesHeld != 4 || me.StandbyBytes != 3*ps {
			t.Fatalf("the daemon's books after TrimStandby: %d pages held, %d standby bytes; want 4 and %d", me.PagesHeld, me.StandbyBytes, 3*ps)
		}
		st, err := c.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Total.StandbyBytes != 3*ps || len(st.Devices) == 0 || st.Devices[0].Pool.StandbyBytes != 3*ps {
			t.Fatalf("pool standby bytes: total %d, device %+v; want %d", st.Total.StandbyBytes, st.Devices, 3*ps)
		}
		allocs := me.AllocationsTotal

		// Back from standby: no Allocate, no driver call, the same pages,
		// their data as it was.
		before = calls()
		if err := r.Map(ctx, 0, 4*ps); err != nil {
			t.Fatal(err)
		}
		if dd := callDelta(calls(), before); len(dd) != 0 {
			t.Fatalf("the map back from standby made driver calls %v; want none", dd)
		}
		if got := regionPageIDs(r); !slices.Equal(got, ids) || r.StandbyBytes() != 0 || r.MappedBytes() != 4*ps {
			t.Fatalf("pages %v after the map back (want %v), %d standby bytes", got, ids, r.StandbyBytes())
		}
		got := make([]byte, len(data))
		if _, err := r.ReadAt(got, int64(2*ps)+100); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("a page back from standby does not hold its data (%v)", err)
		}
		// The USE (not waited for) reaches the daemon's books.
		waitFor(t, 10*time.Second, "the USE counted", func() (bool, string) {
			me, err := s.Own(ctx)
			if err != nil {
				return false, err.Error()
			}
			return me.StandbyBytes == 0, fmt.Sprintf("%d standby bytes", me.StandbyBytes)
		})
		if me, err = s.Own(ctx); err != nil || me.AllocationsTotal != allocs || me.PagesHeld != 4 {
			t.Fatalf("after the map back: %d allocations (was %d), %d pages held (%v)", me.AllocationsTotal, allocs, me.PagesHeld, err)
		}

		// Growing past the standby pages allocates only the missing ones.
		if err := r.UnmapStandby(ctx, 2*ps, 2*ps); err != nil {
			t.Fatal(err)
		}
		before = calls()
		if err := r.Map(ctx, 0, 6*ps); err != nil {
			t.Fatal(err)
		}
		if dd := callDelta(calls(), before); backend == "cuda" && dd["cuMemMap"] != 2 {
			t.Fatalf("a map of 2 standby and 2 missing pages made driver calls %v; want 2 cuMemMap", dd)
		}
		if me, err = s.Own(ctx); err != nil || me.AllocationsTotal != allocs+1 || me.PagesHeld != 6 {
			t.Fatalf("a map of 2 standby and 2 missing pages: %d allocations (want %d), %d pages held (%v)", me.AllocationsTotal, allocs+1, me.PagesHeld, err)
		}

		// A plain Unmap of standby pages frees them.
		if err := r.UnmapStandby(ctx, 4*ps, 2*ps); err != nil {
			t.Fatal(err)
		}
		if err := r.Unmap(ctx, 4*ps, 2*ps); err != nil {
			t.Fatal(err)
		}
		if me, err = s.Own(ctx); err != nil || me.PagesHeld != 4 || me.StandbyBytes != 0 {
			t.Fatalf("after an Unmap of standby pages: %d pages held, %d standby bytes (%v)", me.PagesHeld, me.StandbyBytes, err)
		}

		// Close frees standby pages with the rest.
		if err := r.TrimStandby(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if err := r.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if me, err = s.Own(ctx); err != nil || me.PagesHeld != 0 || me.StandbyBytes != 0 {
			t.Fatalf("after Close: %d pages held, %d standby bytes (%v)", me.PagesHeld, me.StandbyBytes, err)
		}

		// Session.Standby is checked as a Free: all or nothing.
		a, err := s.Allocate(ctx, 2)
		if err != nil {
			t.Fatal(err)
		}
		a.Close()
		if _, err := s.Standby(ctx, []uint64{a.Pages[0].ID, 1 << 60}); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Standby of a page not held: %v", err)
		}
		if n, err := s.Standby(ctx, a.IDs()); err != nil || n != 2 {
			t.Fatalf("Standby: %d, %v", n, err)
		}
		if _, err := s.Free(ctx, a.IDs()); err != nil {
			t.Fatal(err)
		}
		if me, err = s.Own(ctx); err != nil || me.PagesHeld != 0 || me.StandbyBytes != 0 {
			t.Fatalf("after a Free of standby pages: %d pages held, %d standby bytes (%v)", me.PagesHeld, me.StandbyBytes, err)
		}
	})
}

// Where the daemon keeps no standby pages (GetInfo().fd_channel_standby
// false; here the session's copy of Info says so), TrimStandby gives the
// pages back as Trim does and Session.Standby is refused.
func TestStandbyFallsBackToUnmap(t *testing.T) {
	checkGoroutines(t)
	_, c := connect(t, "host")
	ctx := testCtx(t)
	s, err := c.OpenSession(ctx, "go-standby-off")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	s.info.FDChannelStandby = false
	ps := s.Info().Devices[0].PageSize
	r, err := s.NewRegion(ctx, 4*ps)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(ctx)
	if err := r.Map(ctx, 0, 4*ps); err != nil {
		t.Fatal(err)
	}
	if err := r.TrimStandby(ctx, ps); err != nil {
		t.Fatal(err)
	}
	me, err := s.Own(ctx)
	if err != nil || me.PagesHeld != 1 || me.StandbyBytes != 0 || r.StandbyBytes() != 0 || r.MappedBytes() != ps {
		t.Fatalf("TrimStandby without standby pages: %d held, %d standby bytes (%v); region %d mapped, %d standby",
			me.PagesHeld, me.StandbyBytes, err, r.MappedBytes(), r.StandbyBytes())
	}
	if _, err := s.Standby(ctx, regionPageIDs(r)); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("Session.Standby without standby pages: %v", err)
	}
}

// A reclaim asks the session with standby pages first, and its handler's
// ReleasePages gives those first, keeping the page it uses (as
// tests/test_standby.py::test_a_reclaim_asks_the_session_with_standby_pages_and_it_gives_those).
func TestReclaimTakesStandbyPagesFirst(t *testing.T) {
	d := sharedDaemonWith(t, "host-32mib", "host", "--memory-limit", "32MiB", "--reclaim-timeout-ms", "3000")
	checkGoroutines(t)
	d.LogOnFailure(t)
	ctx := testCtx(t)
	c, err := Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var sessions []*Session
	defer func() { // before the client's Close
		for _, s := range sessions {
			s.Close(context.Background())
		}
	}()

	type asked struct {
		name  string
		pages uint64
		gave  int
		err   error
	}
	asks := make(chan asked, 8)
	open := func(name string) (*Session, *Region) {
		t.Helper()
		var r *Region
		ready := make(chan struct{})
		s, err := c.OpenSession(ctx, name, WithReclaimHandler(func(hctx context.Context, ev Reclaim) {
			<-ready
			n, err := r.ReleasePages(hctx, int(ev.Pages), 0)
			asks <- asked{name, ev.Pages, n, err}
		}))
		if err != nil {
			t.Fatal(err)
		}
		sessions = append(sessions, s)
		if r, err = s.NewRegion(ctx, 8*(2<<20)); err != nil {
			t.Fatal(err)
		}
		close(ready)
		if err := r.Map(ctx, 0, 4*r.PageSize()); err != nil {
			t.Fatal(err)
		}
		return s, r
	}
	// busy: opened first, all in use (it would be asked first without
	// standby pages); idle: 1 page in use, 3 standby.
	busy, rb := open("busy")
	_, ri := open("idle")
	ps := ri.PageSize()
	if _, err := ri.WriteAt([]byte("in use"), 0); err != nil {
		t.Fatal(err)
	}
	if err := ri.TrimStandby(ctx, ps); err != nil {
		t.Fatal(err)
	}

	// 16 pages in all, 8 held: 11 more need 3 back.
	s3, err := c.OpenSession(ctx, "newcomer")
	if err != nil {
		t.Fatal(err)
	}
	sessions = append(sessions, s3)
	a, err := s3.Allocate(ctx, 11, WaitUpTo(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	var got []asked
	for len(asks) > 0 || len(got) == 0 {
		select {
		case a := <-asks:
			got = append(got, a)
		case <-time.After(5 * time.Second):
			t.Fatal("no reclaim handler ran")
		}
	}
	if len(got) != 1 || got[0].name != "idle" || got[0].gave != 3 || got[0].err != nil {
		t.Fatalf("reclaims answered: %+v; want the idle session alone, giving its 3 standby pages", got)
	}
	if ri.StandbyBytes() != 0 || ri.MappedBytes() != ps || rb.MappedBytes() != 4*ps {
		t.Fatalf("idle: %d standby, %d mapped; busy: %d mapped", ri.StandbyBytes(), ri.MappedBytes(), rb.MappedBytes())
	}
	b := make([]byte, 6)
	if _, err := ri.ReadAt(b, 0); err != nil || string(b) != "in use" {
		t.Fatalf("the page the idle session uses: %q (%v)", b, err)
	}
	if me, err := busy.Own(ctx); err != nil || me.ReclaimRequests != 0 {
		t.Fatalf("the busy session was asked %d times (%v); want never", me.ReclaimRequests, err)
	}
	st, err := c.Stats(ctx)
	if err != nil || st.Total.StandbyBytes != 0 || st.Total.PagesInUse != 16 {
		t.Fatalf("the pool: %d standby bytes, %d pages in use (%v)", st.Total.StandbyBytes, st.Total.PagesInUse, err)
	}
}

// A restarted daemon does not journal standby: the resumed session says
// again which adopted pages it keeps as standby (a FREE with the standby
// flag on the new channel), so a reclaim still asks for those first; a
// page taken back while the daemon was away is not said again.
func TestStandbyIsSaidAgainAfterResume(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		d, restart := startStateDaemon(t, backend)
		ctx := testCtx(t)
		c, err := Dial(ctx, d.Socket)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := c.OpenSession(ctx, "go-standby-resume")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		ps := s.Info().Devices[0].PageSize
		r, err := s.NewRegion(ctx, 8*ps)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Map(ctx, 0, 4*ps); err != nil {
			t.Fatal(err)
		}
		if _, err := r.WriteAt(pattern(7, 64), 0); err != nil {
			t.Fatal(err)
		}
		if err := r.TrimStandby(ctx, ps); err != nil { // pages 1..3 standby
			t.Fatal(err)
		}
		standbyBytes := func() (uint64, string) {
			own, err := s.Own(ctx)
			if err != nil {
				return 0, err.Error()
			}
			return own.StandbyBytes, fmt.Sprintf("%+v", own)
		}
		if got, _ := standbyBytes(); got != 3*ps {
			t.Fatalf("standby bytes before the restart: %d, want %d", got, 3*ps)
		}
		d.Kill()
		waitFor(t, 5*time.Second, "the session notices the daemon went away", func() (bool, string) {
			return s.m.Resuming(), ""
		})
		if err := r.Map(ctx, ps, ps); err != nil { // page 1 taken back while the daemon is away: no Allocate
			t.Fatalf("taking a standby page back while the daemon is away: %v", err)
		}
		d = restart(filepath.Join(filepath.Dir(d.Socket), "state"))
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		if err := s.WaitResumed(wctx); err != nil {
			t.Fatalf("WaitResumed: %v\n%s", err, d.Log.String())
		}
		waitFor(t, 5*time.Second, "the restarted daemon counts pages 2 and 3 as standby", func() (bool, string) {
			got, why := standbyBytes()
			return got == 2*ps, why
		})
		got := make([]byte, 64)
		if _, err := r.ReadAt(got, 0); err != nil || !bytes.Equal(got, pattern(7, 64)) {
			t.Fatalf("page 0 across the resume: %v", err)
		}
		if err := r.Close(ctx); err != nil {
			t.Fatal(err)
		}
	})
}
