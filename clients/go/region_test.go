package kvcached

import (
	"context"
	"errors"
	"os"
	"slices"
	"testing"
)

// fakePager hands out page ids and records every call. With standby it
// keeps standby pages as the daemon does (checked as a Free).
type fakePager struct {
	next     uint64
	held     map[uint64]bool
	allocs   []int
	frees    [][]uint64
	failNext error

	standby     bool            // the daemon offers standby pages
	standbyIDs  map[uint64]bool // pages held as standby
	standbys    [][]uint64      // standby FREEs
	uses        [][]uint64      // USE records
	failStandby error
}

func (f *fakePager) standbyOK() bool { return f.standby }

func (f *fakePager) standbyPages(_ context.Context, ids []uint64) error {
	if f.failStandby != nil {
		err := f.failStandby
		f.failStandby = nil
		return err
	}
	for _, id := range ids {
		if !f.held[id] {
			return newError(ErrNotFound, "Standby", "page %d not held", id)
		}
	}
	f.standbys = append(f.standbys, ids)
	if f.standbyIDs == nil {
		f.standbyIDs = map[uint64]bool{}
	}
	for _, id := range ids {
		f.standbyIDs[id] = true
	}
	return nil
}

func (f *fakePager) usePages(ids []uint64) {
	f.uses = append(f.uses, ids)
	for _, id := range ids {
		delete(f.standbyIDs, id)
	}
}

func (f *fakePager) allocatePages(_ context.Context, n int, _ string) (*Allocation, error) {
	if f.failNext != nil {
		err := f.failNext
		f.failNext = nil
		return nil, err
	}
	f.allocs = append(f.allocs, n)
	a := &Allocation{ID: uint64(len(f.allocs))}
	for i := 0; i < n; i++ {
		f.next++
		f.held[f.next] = true
		a.Pages = append(a.Pages, Page{ID: f.next})
	}
	return a, nil
}

func (f *fakePager) freePages(_ context.Context, ids []uint64) error {
	f.frees = append(f.frees, ids)
	for _, id := range ids {
		if !f.held[id] {
			return newError(ErrNotFound, "Free", "page %d not held", id)
		}
		delete(f.held, id)
		delete(f.standbyIDs, id)
	}
	return nil
}

func (f *fakePager) forget(*Region) {}

// fakeMapper tracks which addresses are mapped; can fail the Nth map, and
// refuse unmaps (as the CUDA test driver's KVCACHED_TESTDRV_FAIL would).
type fakeMapper struct {
	mapped   map[uintptr]bool
	maps     int
	runs     int
	failAt   int
	released bool
	mem      map[uintptr][]byte

	unmaps      []int            // pages per unmap call, refused ones included
	refuseRuns  bool             // refuse every unmap of more than one page
	refuseUnmap map[uintptr]bool // refuse every unmap that covers this page
}

func (m *fakeMapper) reserve(size uint64) (uintptr, error) { return 1 << 30, nil }
func (m *fakeMapper) release(base uintptr, size uint64) error {
	m.released = true
	return nil
}
func (m *fakeMapper) mapRun(addr uintptr, run pageRun, size uint64) error {
	m.runs++
	return mapEach(m.mapPage, m.unmap, addr, run.files, size)
}
func (m *fakeMapper) mapPage(addr uintptr, f *os.File, size uint64) error {
	m.maps++
	if m.maps == m.failAt {
		return newError(ErrMapping, "fake", "injected")
	}
	if m.mapped[addr] {
		return errors.New("double map")
	}
	m.mapped[addr] = true
	return nil
}

// unmap of one page or a run of adjacent ones: every page of the range
// must be mapped (the test driver's cuMemUnmap: whole mappings, no holes).
func (m *fakeMapper) unmap(addr uintptr, size uint64) error {
	m.unmaps = append(m.unmaps, int(size/pg))
	if m.refuseRuns && size > pg {
		return newError(ErrMapping, "fake", "run unmap refused")
	}
	for a := addr; a < addr+uintptr(size); a += pg {
		if !m.mapped[a] {
			return errors.New("unmap of unmapped page")
		}
		if m.refuseUnmap[a] {
			return newError(ErrMapping, "fake", "unmap refused")
		}
	}
	for a := addr; a < addr+uintptr(size); a += pg {
		delete(m.mapped, a)
	}
	return nil
}
func (m *fakeMapper) write(addr uintptr, p []byte) error {
	m.mem[addr] = append([]byte(nil), p...)
	return nil
}
func (m *fakeMapper) read(addr uintptr, p []byte) error { copy(p, m.mem[addr]); return nil }
func (m *fakeMapper) close()                            {}

const pg = 4096

func newFakeRegion(t *testing.T, size uint64) (*Region, *fakePager, *fakeMapper) {
	t.Helper()
	p := &fakePager{held: map[uint64]bool{}}
	m := &fakeMapper{mapped: map[uintptr]bool{}, mem: map[uintptr][]byte{}}
	r, err := newRegion(p, m, Device{UUID: "HOST-0", Kind: "host", PageSize: pg}, size)
	if err != nil {
		t.Fatal(err)
	}
	return r, p, m
}

func TestRegionArithmetic(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 10*pg-100) // rounds up to 10 pages
	if r.Size() != 10*pg || r.Ptr() != 1<<30 {
		t.Fatalf("size %d ptr %x", r.Size(), r.Ptr())
	}
	// Prefix growth: 1 byte -> one page, then up to 3 pages -> 2 more.
	if err := r.Grow(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := r.Grow(ctx, 2*pg+1); err != nil {
		t.Fatal(err)
	}
	if err := r.Grow(ctx, 3*pg); err != nil { // already mapped: no call
		t.Fatal(err)
	}
	// A separate range [6,8) and an overlapping one [5,9): exactly 2 missing.
	if err := r.Map(ctx, 6*pg, 2*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.Map(ctx, 5*pg, 4*pg); err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 2, 2, 2}; !equalInts(p.allocs, want) {
		t.Fatalf("Allocate calls %v, want %v", p.allocs, want)
	}
	if r.MappedBytes() != 7*pg || len(m.mapped) != 7 || !r.IsMapped(5*pg, 4*pg) || r.IsMapped(3*pg, pg) {
		t.Fatalf("mapped %d bytes, %d in mapper", r.MappedBytes(), len(m.mapped))
	}
	// Unmap a range with a hole in it: frees exactly the mapped pages.
	if err := r.Unmap(ctx, 2*pg, 5*pg); err != nil { // pages 2..6: 2,5,6 mapped
		t.Fatal(err)
	}
	if got := p.frees[len(p.frees)-1]; len(got) != 3 {
		t.Fatalf("Free %v, want 3 pages", got)
	}
	// Trim keeps the first pages.
	if err := r.Trim(ctx, pg+1); err != nil { // keeps pages 0,1
		t.Fatal(err)
	}
	if r.MappedBytes() != 2*pg || len(p.held) != 2 {
		t.Fatalf("after trim: %d bytes mapped, %d held", r.MappedBytes(), len(p.held))
	}
	if err := r.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if len(p.held) != 0 || len(m.mapped) != 0 || !m.released {
		t.Fatalf("after close: held %v mapped %v released %v", p.held, m.mapped, m.released)
	}
	if err := r.Map(ctx, 0, pg); !errors.Is(err, ErrClosed) {
		t.Fatalf("map after close: %v", err)
	}
}

// A range that runs to the region's end (the size it was created with, not
// a whole number of pages) releases its last page: every page can go back.
func TestRegionRangeToTheEndReleasesTheLastPage(t *testing.T) {
	ctx := context.Background()
	size := uint64(10*pg - 100)
	r, p, m := newFakeRegion(t, size)
	if err := r.Map(ctx, 0, size); err != nil {
		t.Fatal(err)
	}
	if err := r.Unmap(ctx, 8*pg, size-8*pg); err != nil {
		t.Fatal(err)
	}
	if got := p.frees[len(p.frees)-1]; len(got) != 2 || r.IsMapped(9*pg, 1) || !r.IsMapped(7*pg, pg) {
		t.Fatalf("Free %v after unmapping [8 pages, end): want pages 8 and 9", got)
	}
	if err := r.Unmap(ctx, 0, size); err != nil {
		t.Fatal(err)
	}
	if r.MappedBytes() != 0 || len(p.held) != 0 || len(m.mapped) != 0 {
		t.Fatalf("after unmapping [0, end): %d bytes mapped, %d held", r.MappedBytes(), len(p.held))
	}
	// Trim(0) gives back everything
	if err := r.Map(ctx, 0, size); err != nil {
		t.Fatal(err)
	}
	if err := r.Trim(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if r.MappedBytes() != 0 || len(p.held) != 0 {
		t.Fatalf("after Trim(0): %d bytes mapped, %d held", r.MappedBytes(), len(p.held))
	}
}

func TestRegionErrors(t *testing.T) {
	ctx := context.Background()
	r, p, _ := newFakeRegion(t, 4*pg)
	for _, c := range []struct {
		off, n uint64
	}{{1, pg}, {0, 5 * pg}, {4 * pg, 1}, {5 * pg, 0}, {pg, ^uint64(0)}} {
		if err := r.Map(ctx, c.off, c.n); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("Map(%d, %d): %v", c.off, c.n, err)
		}
	}
	if err := r.Unmap(ctx, 3, pg); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("Unmap unaligned: %v", err)
	}
	if _, err := r.WriteAt([]byte("x"), 0); !errors.Is(err, ErrNotMapped) {
		t.Errorf("write to unmapped: %v", err)
	}
	if _, err := r.ReadAt(make([]byte, 1), -1); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("negative offset: %v", err)
	}
	p.failNext = newError(ErrResourceExhausted, "Allocate", "budget")
	if err := r.Map(ctx, 0, pg); !errors.Is(err, ErrResourceExhausted) || r.MappedBytes() != 0 {
		t.Errorf("allocate failure: %v", err)
	}
	if _, err := newRegion(p, &fakeMapper{}, Device{PageSize: pg}, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("zero size: %v", err)
	}
}

// A mapping failure in the middle of a Map rolls everything back.
func TestRegionMapRollback(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 8*pg)
	if err := r.Grow(ctx, pg); err != nil {
		t.Fatal(err)
	}
	m.failAt = m.maps + 3 // third page of the next Map fails
	if err := r.Grow(ctx, 5*pg); !errors.Is(err, ErrMapping) {
		t.Fatalf("got %v", err)
	}
	if r.MappedBytes() != pg || len(m.mapped) != 1 || len(p.held) != 1 {
		t.Fatalf("after rollback: %d bytes, %d mapped, %d held", r.MappedBytes(), len(m.mapped), len(p.held))
	}
	if _, err := r.WriteAt([]byte("abc"), 0); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 3)
	if _, err := r.ReadAt(buf, 0); err != nil || string(buf) != "abc" {
		t.Fatalf("read %q %v", buf, err)
	}
}

// A Map maps each run of adjacent missing pages with one mapRun (one
// cuMemSetAccess per run on CUDA), and a failure in a later run rolls back
// the earlier runs too.
func TestRegionMapsRunsOfAdjacentPages(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 8*pg)
	if err := r.Map(ctx, 2*pg, pg); err != nil { // page 2 first: pages 0-5 are then two runs, 0-1 and 3-5
		t.Fatal(err)
	}
	runs := m.runs
	m.failAt = m.maps + 4 // the 2nd page of the second run
	if err := r.Map(ctx, 0, 6*pg); !errors.Is(err, ErrMapping) {
		t.Fatalf("got %v", err)
	}
	if m.runs-runs != 2 || r.MappedBytes() != pg || len(m.mapped) != 1 || len(p.held) != 1 {
		t.Fatalf("after rollback: %d runs, %d bytes, %d mapped, %d held", m.runs-runs, r.MappedBytes(), len(m.mapped), len(p.held))
	}
	runs = m.runs
	if err := r.Map(ctx, 0, 6*pg); err != nil {
		t.Fatal(err)
	}
	if m.runs-runs != 2 || r.MappedBytes() != 6*pg || len(m.mapped) != 6 || len(p.held) != 6 {
		t.Fatalf("mapped: %d runs, %d bytes, %d mapped, %d held", m.runs-runs, r.MappedBytes(), len(m.mapped), len(p.held))
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The host mapper really maps memfd pages over a PROT_NONE reservation.
func TestHostMapperMemfd(t *testing.T) {
	var m hostMapper
	base, err := m.reserve(4 * pg)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		f := memfdPage(t, pg)
		if err := m.mapPage(base+uintptr(i*pg), f, pg); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.write(base+pg-2, []byte("span")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	_ = m.read(base+pg-2, got)
	if string(got) != "span" {
		t.Fatalf("read back %q", got)
	}
	// The two pages unmapped with one call (a run): fresh pages mapped there
	// again read zeros, not "span".
	if err := m.unmap(base, 2*pg); err != nil {
		t.Fatal(err)
	}
	if err := m.mapRun(base, pageRun{files: []*os.File{memfdPage(t, pg), memfdPage(t, pg)}}, pg); err != nil {
		t.Fatal(err)
	}
	_ = m.read(base+pg-2, got)
	if string(got) != "\x00\x00\x00\x00" {
		t.Fatalf("after unmapping the run and mapping fresh pages: read %q", got)
	}
	if err := m.unmap(base, 2*pg); err != nil {
		t.Fatal(err)
	}
	if err := m.release(base, 4*pg); err != nil {
		t.Fatal(err)
	}
}

// Unmapping gives back each run of adjacent pages with one mapper unmap
// (one cuMemUnmap on CUDA): one run is one call, two runs two calls; a
// refused run is unmapped page by page and everything freed; a page that
// cannot be unmapped stays mapped, on the books and not freed, and the
// error is returned.
func TestRegionUnmapsRunsOfAdjacentPages(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 8*pg)
	if err := r.Map(ctx, 0, 8*pg); err != nil {
		t.Fatal(err)
	}
	// One run: one call.
	m.unmaps = nil
	if err := r.Unmap(ctx, 0, 3*pg); err != nil {
		t.Fatal(err)
	}
	if !equalInts(m.unmaps, []int{3}) || len(p.frees) != 1 || len(p.frees[0]) != 3 || len(p.held) != 5 {
		t.Fatalf("Unmap of one run: unmap calls (pages each) %v, frees %v, %d held", m.unmaps, p.frees, len(p.held))
	}
	// Two runs (pages 0-1 and 3-7, page 2 unmapped before): two calls.
	if err := r.Map(ctx, 0, 8*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.Unmap(ctx, 2*pg, pg); err != nil {
		t.Fatal(err)
	}
	m.unmaps, p.frees = nil, nil
	if err := r.Trim(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if !equalInts(m.unmaps, []int{2, 5}) || len(p.frees) != 1 || len(p.frees[0]) != 7 || len(p.held) != 0 || len(m.mapped) != 0 {
		t.Fatalf("Trim of two runs: unmap calls %v, frees %v, %d held, %d mapped", m.unmaps, p.frees, len(p.held), len(m.mapped))
	}
	// ReleasePages: standby pages 2, 3 and the page in use 4 are one run
	// (the Free still names them in the order given: standby first).
	p.standby = true
	if err := r.Map(ctx, 0, 5*pg); err != nil {
		t.Fatal(err)
	}
	if err := r.UnmapStandby(ctx, 2*pg, 2*pg); err != nil {
		t.Fatal(err)
	}
	want := idsOf(r, 3, 2, 4)
	m.unmaps, p.frees = nil, nil
	if n, err := r.ReleasePages(ctx, 3, 0); err != nil || n != 3 || !equalInts(m.unmaps, []int{3}) || !slices.Equal(p.frees[0], want) {
		t.Fatalf("ReleasePages(3): %d, %v; unmap calls %v, freed %v (want %v)", n, err, m.unmaps, p.frees, want)
	}
	// A refused run: page by page, everything unmapped and freed.
	if err := r.Map(ctx, 0, 8*pg); err != nil {
		t.Fatal(err)
	}
	m.unmaps, p.frees, m.refuseRuns = nil, nil, true
	if err := r.Unmap(ctx, 0, 4*pg); err != nil {
		t.Fatalf("Unmap with the run refused: %v", err)
	}
	if !equalInts(m.unmaps, []int{4, 1, 1, 1, 1}) || len(p.frees) != 1 || len(p.frees[0]) != 4 || r.MappedBytes() != 4*pg || len(m.mapped) != 4 {
		t.Fatalf("refused run: unmap calls %v, frees %v, %d mapped", m.unmaps, p.frees, r.MappedBytes())
	}
	// A page that cannot be unmapped (5, in the run 4-6): kept and not
	// freed; the others go; the error says so.
	stuck := idsOf(r, 5)[0]
	m.unmaps, p.frees, m.refuseUnmap = nil, nil, map[uintptr]bool{r.addr(5): true}
	if err := r.Unmap(ctx, 4*pg, 3*pg); !errors.Is(err, ErrMapping) {
		t.Fatalf("Unmap with page 5 refused: %v", err)
	}
	if !equalInts(m.unmaps, []int{3, 1, 1, 1}) || len(p.frees) != 1 || slices.Contains(p.frees[0], stuck) || len(p.frees[0]) != 2 {
		t.Fatalf("a stuck page: unmap calls %v, frees %v (page %d must not be freed)", m.unmaps, p.frees, stuck)
	}
	if !r.IsMapped(5*pg, pg) || r.MappedBytes() != 2*pg || !p.held[stuck] || !m.mapped[r.addr(5)] {
		t.Fatalf("a stuck page: mapped %v, %d bytes mapped, held %v", r.IsMapped(5*pg, pg), r.MappedBytes(), p.held[stuck])
	}
	// Once the mapper lets go, Close gives it back with the rest.
	m.refuseUnmap, m.refuseRuns = nil, false
	if err := r.Close(ctx); err != nil || len(p.held) != 0 || len(m.mapped) != 0 || !m.released {
		t.Fatalf("Close: %v, %d held, %d mapped", err, len(p.held), len(m.mapped))
	}
}

// A Map that fails rolls back by runs; a page it cannot unmap stays
// mapped and held (not freed), the others are given back.
func TestRegionMapRollbackKeepsAPageItCannotUnmap(t *testing.T) {
	ctx := context.Background()
	r, p, m := newFakeRegion(t, 8*pg)
	if err := r.Map(ctx, 2*pg, pg); err != nil { // pages 0-3 are then runs 0-1 and 3
		t.Fatal(err)
	}
	m.failAt = m.maps + 3 // page 3
	m.refuseUnmap = map[uintptr]bool{r.addr(0): true}
	m.unmaps = nil
	if err := r.Map(ctx, 0, 4*pg); !errors.Is(err, ErrMapping) {
		t.Fatalf("got %v", err)
	}
	if !equalInts(m.unmaps, []int{2, 1, 1}) || !r.IsMapped(0, pg) || r.IsMapped(pg, pg) || r.MappedBytes() != 2*pg || len(p.held) != 2 {
		t.Fatalf("after rollback: unmap calls %v, %d bytes mapped, %d held", m.unmaps, r.MappedBytes(), len(p.held))
	}
	m.refuseUnmap = nil
	if err := r.Close(ctx); err != nil || len(p.held) != 0 || len(m.mapped) != 0 {
		t.Fatalf("Close: %v, %d held, %d mapped", err, len(p.held), len(m.mapped))
	}
}
