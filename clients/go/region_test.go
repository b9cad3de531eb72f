package kvcached

import (
	"context"
	"errors"
	"os"
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

// fakeMapper tracks which addresses are mapped; can fail the Nth map.
type fakeMapper struct {
	mapped   map[uintptr]bool
	maps     int
	runs     int
	failAt   int
	released bool
	mem      map[uintptr][]byte
}

func (m *fakeMapper) reserve(size uint64) (uintptr, error) { return 1 << 30, nil }
func (m *fakeMapper) release(base uintptr, size uint64) error {
	m.released = true
	return nil
}
func (m *fakeMapper) mapRun(addr uintptr, run pageRun, size uint64) error {
	m.runs++
	return mapEach(m.mapPage, m.unmapPage, addr, run.files, size)
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
func (m *fakeMapper) unmapPage(addr uintptr, size uint64) error {
	if !m.mapped[addr] {
		return errors.New("unmap of unmapped page")
	}
	delete(m.mapped, addr)
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
	for i := 0; i < 2; i++ {
		if err := m.unmapPage(base+uintptr(i*pg), pg); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.release(base, 4*pg); err != nil {
		t.Fatal(err)
	}
}
