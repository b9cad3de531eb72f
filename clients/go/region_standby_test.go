package kvcached

import (
	"context"
	"errors"
	"slices"
	"testing"
)

// Standby pages in a Region, against the fake pager and mapper
// (docs/protocol.md, "Standby pages"; the daemon's side is in
// standby_test.go).

// idsOf is the page ids of slots idx.
func idsOf(r *Region, idx ...int) []uint64 {
	var ids []uint64
	for _, i := range idx {
		ids = append(ids, r.slots[i].id)
	}
	return ids
}

func TestRegionStandbyTrimAndRegrow(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 10*pg)
	p.standby = true
	if err := r.Map(ctx, 0, 8*pg); err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteAt([]byte("still here"), 5*pg); err != nil {
		t.Fatal(err)
	}
	standby := idsOf(r, 2, 3, 4, 5, 6, 7)
	maps := m.maps
	if err := r.TrimStandby(ctx, pg+1); err != nil { // keeps pages 0, 1
		t.Fatal(err)
	}
	if len(p.standbys) != 1 || !slices.Equal(p.standbys[0], standby) || len(p.frees) != 0 {
		t.Fatalf("standby FREEs %v, Frees %v; want one standby FREE of %v", p.standbys, p.frees, standby)
	}
	if r.MappedBytes() != 2*pg || r.StandbyBytes() != 6*pg || len(m.mapped) != 8 {
		t.Fatalf("after TrimStandby: %d bytes mapped, %d standby, %d pages in the mapper", r.MappedBytes(), r.StandbyBytes(), len(m.mapped))
	}
	// From the caller's view the range is unmapped.
	if r.IsMapped(5*pg, pg) || !r.IsMapped(0, 2*pg) {
		t.Fatal("IsMapped sees standby pages")
	}
	if _, err := r.ReadAt(make([]byte, 10), 5*pg); !errors.Is(err, ErrNotMapped) {
		t.Fatalf("ReadAt of a standby page: %v", err)
	}
	if _, err := r.WriteAt([]byte("x"), 5*pg); !errors.Is(err, ErrNotMapped) {
		t.Fatalf("WriteAt of a standby page: %v", err)
	}
	// Again: nothing left in use past page 2, no call.
	if err := r.UnmapStandby(ctx, 2*pg, 8*pg); err != nil || len(p.standbys) != 1 {
		t.Fatalf("UnmapStandby of standby and unmapped pages: %v, %d standby FREEs", err, len(p.standbys))
	}

	// Map takes the standby pages back (one USE, no Allocate, no map) and
	// allocates only the two missing pages.
	if err := r.Map(ctx, 0, 10*pg); err != nil {
		t.Fatal(err)
	}
	if len(p.uses) != 1 || !slices.Equal(p.uses[0], standby) {
		t.Fatalf("USE records %v, want one of %v", p.uses, standby)
	}
	if !equalInts(p.allocs, []int{8, 2}) || m.maps-maps != 2 {
		t.Fatalf("Allocate calls %v, %d maps; want [8 2] and 2 maps", p.allocs, m.maps-maps)
	}
	if r.MappedBytes() != 10*pg || r.StandbyBytes() != 0 || len(p.standbyIDs) != 0 {
		t.Fatalf("after the map: %d bytes mapped, %d standby, %d standby at the daemon", r.MappedBytes(), r.StandbyBytes(), len(p.standbyIDs))
	}
	got := make([]byte, 10)
	if _, err := r.ReadAt(got, 5*pg); err != nil || string(got) != "still here" {
		t.Fatalf("page 5 back from standby holds %q (%v)", got, err)
	}

	// Close frees everything, standby pages included.
	if err := r.UnmapStandby(ctx, 4*pg, 2*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if len(p.held) != 0 || len(m.mapped) != 0 || !m.released {
		t.Fatalf("after Close: held %v, mapped %v, released %v", p.held, m.mapped, m.released)
	}
}

// A plain Unmap or Trim of standby pages unmaps and frees them.
func TestRegionStandbyPagesAreFreedByUnmap(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 4*pg)
	p.standby = true
	if err := r.Map(ctx, 0, 4*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.UnmapStandby(ctx, 2*pg, 2*pg); err != nil {
		t.Fatal(err)
	}
	ids := idsOf(r, 2, 3)
	if err := r.Unmap(ctx, pg, 3*pg); err != nil {
		t.Fatal(err)
	}
	if len(p.frees) != 1 || len(p.frees[0]) != 3 || !slices.Contains(p.frees[0], ids[0]) || !slices.Contains(p.frees[0], ids[1]) {
		t.Fatalf("Frees %v; want pages 1 to 3, standby ones %v included", p.frees, ids)
	}
	if r.MappedBytes() != pg || r.StandbyBytes() != 0 || len(m.mapped) != 1 || len(p.held) != 1 {
		t.Fatalf("%d bytes mapped, %d standby, %d in the mapper, %d held", r.MappedBytes(), r.StandbyBytes(), len(m.mapped), len(p.held))
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// ReleasePages gives standby pages first (from the end), then pages in use
// from the end, never below keepBytes.
func TestRegionReleasePagesGivesStandbyFirst(t *testing.T) {
	ctx := context.Background()
	r, p, _ := newFakeRegion(t, 8*pg)
	p.standby = true
	if err := r.Map(ctx, 0, 8*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.UnmapStandby(ctx, 2*pg, 2*pg); err != nil { // 2, 3 standby
		t.Fatal(err)
	}
	want := idsOf(r, 3, 2, 7)
	n, err := r.ReleasePages(ctx, 3, 0)
	if err != nil || n != 3 {
		t.Fatalf("ReleasePages(3): %d, %v", n, err)
	}
	if len(p.frees) != 1 || !slices.Equal(p.frees[0], want) {
		t.Fatalf("freed %v, want %v (the standby pages from the end, then the last page in use)", p.frees, want)
	}
	if r.StandbyBytes() != 0 || r.MappedBytes() != 5*pg || !r.IsMapped(0, 2*pg) || !r.IsMapped(4*pg, 3*pg) || r.IsMapped(7*pg, pg) {
		t.Fatalf("after ReleasePages(3): %d standby, %d mapped", r.StandbyBytes(), r.MappedBytes())
	}
	// Never below keepBytes: pages 0, 1, 4, 5, 6 in use, keep the first 5.
	if n, err := r.ReleasePages(ctx, 10, 4*pg+1); err != nil || n != 2 || r.MappedBytes() != 3*pg || !r.IsMapped(4*pg, pg) {
		t.Fatalf("ReleasePages(10, keep 5 pages): %d, %v, %d mapped", n, err, r.MappedBytes())
	}
	// Standby pages below keepBytes go all the same: nobody uses them.
	if err := r.TrimStandby(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if n, err := r.ReleasePages(ctx, 2, 8*pg); err != nil || n != 2 || r.StandbyBytes() != pg {
		t.Fatalf("ReleasePages(2) of standby pages under keepBytes: %d, %v, %d standby left", n, err, r.StandbyBytes())
	}
	if err := r.Close(ctx); err != nil || len(p.held) != 0 {
		t.Fatalf("Close: %v, %d held", err, len(p.held))
	}
}

// Without the daemon's standby pages, UnmapStandby and TrimStandby give the
// pages back; a refused standby FREE changes nothing; a Map that fails
// after taking standby pages back keeps them as standby again.
func TestRegionStandbyFallbackAndErrors(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 4*pg)
	if err := r.Map(ctx, 0, 4*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.TrimStandby(ctx, 2*pg); err != nil {
		t.Fatal(err)
	}
	if len(p.standbys) != 0 || len(p.frees) != 1 || len(p.frees[0]) != 2 || r.StandbyBytes() != 0 || len(m.mapped) != 2 {
		t.Fatalf("TrimStandby without standby pages: standby FREEs %v, Frees %v, %d in the mapper", p.standbys, p.frees, len(m.mapped))
	}

	p.standby = true
	p.failStandby = newError(ErrUnavailable, "Standby", "the daemon is away")
	if err := r.UnmapStandby(ctx, 0, 2*pg); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("UnmapStandby refused: %v", err)
	}
	if r.MappedBytes() != 2*pg || r.StandbyBytes() != 0 {
		t.Fatalf("a refused standby changed the region: %d mapped, %d standby", r.MappedBytes(), r.StandbyBytes())
	}

	if err := r.UnmapStandby(ctx, pg, pg); err != nil {
		t.Fatal(err)
	}
	p.failNext = newError(ErrResourceExhausted, "Allocate", "budget exhausted")
	if err := r.Map(ctx, 0, 4*pg); !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("Map: %v", err)
	}
	if len(p.uses) != 1 || len(p.standbys) != 2 || r.StandbyBytes() != pg || r.MappedBytes() != pg || !p.standbyIDs[r.slots[1].id] {
		t.Fatalf("after a failed Map: USE %v, standby FREEs %v, %d standby, %d mapped; want page 1 standby again",
			p.uses, p.standbys, r.StandbyBytes(), r.MappedBytes())
	}
	if err := r.Map(ctx, 0, 2*pg); err != nil || r.MappedBytes() != 2*pg {
		t.Fatalf("Map of the standby page: %v", err)
	}
	if err := r.Close(ctx); err != nil || len(p.held) != 0 {
		t.Fatalf("Close: %v, %d held", err, len(p.held))
	}
}
