package kvcached

import (
	"context"
	"errors"
	"os"
	"slices"
	"sync"
)

// pager is what a Region needs from a Session (a fake in unit tests).
type pager interface {
	allocatePages(ctx context.Context, n int, device string) (*Allocation, error)
	freePages(ctx context.Context, ids []uint64) error
	// standbyOK: the daemon keeps standby pages (Info.FDChannelStandby).
	standbyOK() bool
	// standbyPages: a FREE with the standby flag (Session.Standby).
	standbyPages(ctx context.Context, ids []uint64) error
	// usePages: USE, not waited for (Session.Use).
	usePages(ids []uint64)
	forget(r *Region)
}

// Region is a reservation of address space (device address space for CUDA
// devices) of which any page-aligned range can be backed by daemon pages.
// The common use is a prefix that grows and shrinks, one Region per
// tensor or one Region holding many tensors at page-aligned offsets. A
// Region is safe for concurrent use; its methods are serialised.
//
// Standby (docs/protocol.md, "Standby pages"): UnmapStandby and
// TrimStandby keep the range's pages mapped and the session's, but not in
// use; mapping the range again takes them back with no Allocate and no
// driver call (a USE record, not waited for), allocating only what is
// missing. From the caller's view a standby range is unmapped
// (MappedBytes, IsMapped, ReadAt and WriteAt); StandbyBytes counts it.
// Unmap, Trim and Close free standby pages like mapped ones, and
// ReleasePages gives them first.
type Region struct {
	p       pager
	m       mapper
	dev     Device
	base    uintptr
	size    uint64
	page    uint64
	mu      sync.Mutex
	slots   []slot
	mapped  int // slots mapped, standby ones included
	standby int // slots mapped as standby
	closed  bool
}

// slot is one page of the region: mapped (with page id), and standby when
// the page stays mapped but is not in use (the caller unmapped it).
type slot struct {
	mapped  bool
	standby bool
	id      uint64
}

// live: mapped and in use (not standby).
func (s slot) live() bool { return s.mapped && !s.standby }

// RegionOption configures NewRegion.
type RegionOption func(*regionOptions)

type regionOptions struct{ device string }

// RegionOnDevice picks the device by UUID (default: the daemon's first).
func RegionOnDevice(uuid string) RegionOption {
	return func(o *regionOptions) { o.device = uuid }
}

// NewRegion reserves size bytes (rounded up to whole pages) of address
// space for pages of one device. Nothing is mapped yet.
func (s *Session) NewRegion(ctx context.Context, size uint64, opts ...RegionOption) (*Region, error) {
	var o regionOptions
	for _, opt := range opts {
		opt(&o)
	}
	if len(s.info.Devices) == 0 {
		return nil, newError(ErrNotFound, "NewRegion", "the daemon serves no device")
	}
	dev := s.info.Devices[0]
	if o.device != "" {
		found := false
		for _, d := range s.info.Devices {
			if d.UUID == o.device {
				dev, found = d, true
			}
		}
		if !found {
			return nil, newError(ErrNotFound, "NewRegion", "device %q is not served by the daemon", o.device)
		}
	}
	return s.regs.add(dev, size)
}

func newRegion(p pager, m mapper, dev Device, size uint64) (*Region, error) {
	if dev.PageSize == 0 {
		return nil, newError(ErrInvalidArgument, "NewRegion", "device %s reports page size 0", dev.UUID)
	}
	if size == 0 {
		return nil, newError(ErrInvalidArgument, "NewRegion", "size 0")
	}
	n := (size + dev.PageSize - 1) / dev.PageSize
	size = n * dev.PageSize
	base, err := m.reserve(size)
	if err != nil {
		return nil, err
	}
	return &Region{p: p, m: m, dev: dev, base: base, size: size, page: dev.PageSize, slots: make([]slot, n)}, nil
}

// Ptr is the base address of the reservation (a device pointer for CUDA).
func (r *Region) Ptr() uintptr { return r.base }

// Size is the reserved size in bytes (a multiple of PageSize).
func (r *Region) Size() uint64 { return r.size }

// PageSize is the size of the device's pages.
func (r *Region) PageSize() uint64 { return r.page }

// Device is the device whose pages back the region.
func (r *Region) Device() Device { return r.dev }

// MappedBytes is how much of the region is backed by pages in use
// (standby pages left out).
func (r *Region) MappedBytes() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return uint64(r.mapped-r.standby) * r.page
}

// StandbyBytes is how much of the region is kept mapped as standby
// (UnmapStandby, TrimStandby): unmapped from the caller's view, taken back
// by Map at no cost.
func (r *Region) StandbyBytes() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return uint64(r.standby) * r.page
}

// IsMapped reports whether every page of [off, off+length) is mapped (and
// not standby).
func (r *Region) IsMapped(off, length uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	first, end, err := r.pagesOf("IsMapped", off, length, false)
	if err != nil {
		return false
	}
	for i := first; i < end; i++ {
		if !r.slots[i].live() {
			return false
		}
	}
	return true
}

// pagesOf turns a byte range into page indexes [first, end). The range
// covers every page it touches; with aligned, off must be page aligned.
func (r *Region) pagesOf(op string, off, length uint64, aligned bool) (int, int, error) {
	if r.closed {
		return 0, 0, newError(ErrClosed, op, "region is closed")
	}
	if aligned && off%r.page != 0 {
		return 0, 0, newError(ErrInvalidArgument, op, "offset %d is not a multiple of the page size %d", off, r.page)
	}
	if off > r.size || length > r.size-off {
		return 0, 0, newError(ErrInvalidArgument, op, "range [%d, %d+%d) is outside the region of %d bytes", off, off, length, r.size)
	}
	first := off / r.page
	end := (off + length + r.page - 1) / r.page
	return int(first), int(end), nil
}

// Map backs [off, off+length) with pages: off must be page aligned; the end
// is rounded up to a page. Pages already mapped stay; standby pages of the
// range are taken back into use (no Allocate, no driver call: one USE
// record, not waited for); exactly the missing pages are borrowed, in one
// Allocate call, and mapped. All or nothing: on error nothing new is
// mapped and nothing more is held (standby pages taken back are kept as
// standby again).
func (r *Region) Map(ctx context.Context, off, length uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	first, end, err := r.pagesOf("Region.Map", off, length, true)
	if err != nil {
		return err
	}
	var missing, back []int
	for i := first; i < end; i++ {
		switch {
		case r.slots[i].standby:
			back = append(back, i)
		case !r.slots[i].mapped:
			missing = append(missing, i)
		}
	}
	if len(back) > 0 {
		// In use again, and the daemon told before the ALLOCATE (the same
		// channel, in order): a reclaim it starts does not count them.
		r.p.usePages(r.setStandby(back, false))
	}
	if len(missing) == 0 {
		return nil
	}
	a, err := r.p.allocatePages(ctx, len(missing), r.dev.UUID)
	if err != nil {
		r.restandby(ctx, back)
		return err
	}
	if len(a.Pages) != len(missing) {
		a.Close()
		_ = r.p.freePages(context.WithoutCancel(ctx), a.IDs())
		r.restandby(ctx, back)
		return newError(ErrProtocol, "Region.Map", "asked for %d pages, got %d", len(missing), len(a.Pages))
	}
	// each run of adjacent missing pages with one mapRun (CUDA: one cuMemSetAccess per run)
	for k := 0; k < len(missing); {
		n := 1
		for k+n < len(missing) && missing[k+n] == missing[k+n-1]+1 {
			n++
		}
		run := pageRun{files: make([]*os.File, n), ids: make([]uint64, n), gen: a.gen}
		for x := range run.files {
			run.files[x], run.ids[x] = a.Pages[k+x].File, a.Pages[k+x].ID
			a.Pages[k+x].File = nil
		}
		if err := r.m.mapRun(r.addr(missing[k]), run, r.page); err != nil {
			// Roll back: unmap what this call mapped (by runs), give back
			// everything but a page whose unmap failed (still mapped: it
			// stays on the books, as unmapSlotsLocked keeps it).
			_, _ = r.unmapSlotsLocked(ctx, missing[:k], false)
			stuck := map[uint64]bool{}
			for _, j := range missing[:k] {
				if r.slots[j].mapped {
					stuck[r.slots[j].id] = true
				}
			}
			ids := a.IDs()
			if len(stuck) > 0 {
				ids = slices.DeleteFunc(ids, func(id uint64) bool { return stuck[id] })
			}
			a.Close()
			_ = r.p.freePages(context.WithoutCancel(ctx), ids)
			r.restandby(ctx, back)
			return err
		}
		for x := 0; x < n; x++ {
			r.slots[missing[k+x]] = slot{mapped: true, id: a.Pages[k+x].ID}
			r.mapped++
		}
		k += n
	}
	return nil
}

// setStandby marks slots idx standby (or in use again) and returns their
// page ids.
func (r *Region) setStandby(idx []int, standby bool) []uint64 {
	ids := make([]uint64, len(idx))
	for k, i := range idx {
		r.slots[i].standby = standby
		ids[k] = r.slots[i].id
	}
	if standby {
		r.standby += len(idx)
	} else {
		r.standby -= len(idx)
	}
	return ids
}

// restandby: a Map failed after it took slots idx back from standby; they
// are made standby again (if the daemon refuses, they stay in use: still
// held and mapped).
func (r *Region) restandby(ctx context.Context, idx []int) {
	if len(idx) == 0 {
		return
	}
	ids := make([]uint64, len(idx))
	for k, i := range idx {
		ids[k] = r.slots[i].id
	}
	if r.p.standbyPages(context.WithoutCancel(ctx), ids) == nil {
		r.setStandby(idx, true)
	}
}

// Unmap unmaps the pages of [off, off+length) that are mapped, standby
// ones included (off page aligned, the end rounded up to a page), and
// frees them in one Free call. A range that runs to the region's end
// therefore releases its last page too.
func (r *Region) Unmap(ctx context.Context, off, length uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	first, end, err := r.pagesOf("Region.Unmap", off, length, true)
	if err != nil {
		return err
	}
	return r.unmapLocked(ctx, first, end, true)
}

func (r *Region) unmapLocked(ctx context.Context, first, end int, free bool) error {
	var idx []int
	for i := first; i < end; i++ {
		if r.slots[i].mapped {
			idx = append(idx, i)
		}
	}
	_, err := r.unmapSlotsLocked(ctx, idx, free)
	return err
}

// unmapSlotsLocked unmaps the mapped slots idx (standby or not, in any
// order) and, with free, frees their pages in one Free call, in the order
// of idx. Each run of adjacent slots is unmapped with one mapper call over
// the run (on CUDA one cuMemUnmap over the run's mappings); a run the
// mapper refuses is unmapped page by page, and a page whose unmap fails
// stays mapped and on the books (not freed). It returns the pages unmapped
// and the first unmap error (joined with Free's).
func (r *Region) unmapSlotsLocked(ctx context.Context, idx []int, free bool) (int, error) {
	sorted := slices.Clone(idx)
	slices.Sort(sorted)
	sorted = slices.Compact(sorted)
	gone := make(map[int]bool, len(sorted))
	var first error
	for k := 0; k < len(sorted); {
		n := 1
		for k+n < len(sorted) && sorted[k+n] == sorted[k+n-1]+1 {
			n++
		}
		run := sorted[k : k+n]
		k += n
		if n > 1 && r.m.unmap(r.addr(run[0]), uint64(n)*r.page) == nil {
			for _, i := range run {
				gone[i] = true
			}
			continue
		}
		for _, i := range run { // one page, or a run refused: page by page
			if err := r.m.unmap(r.addr(i), r.page); err != nil {
				if first == nil {
					first = err
				}
				continue // still mapped: keep it (and do not Free it)
			}
			gone[i] = true
		}
	}
	ids := make([]uint64, 0, len(gone))
	for _, i := range idx {
		if !gone[i] {
			continue
		}
		delete(gone, i)
		ids = append(ids, r.slots[i].id)
		if r.slots[i].standby {
			r.standby--
		}
		r.slots[i] = slot{}
		r.mapped--
	}
	errs := []error{first}
	if free && len(ids) > 0 {
		errs = append(errs, r.p.freePages(ctx, ids))
	}
	return len(ids), errors.Join(errs...)
}

// UnmapStandby is Unmap that keeps the pages mapped as standby
// (docs/protocol.md, "Standby pages"): still the session's and still
// mapped in this process, but not in use. From the caller's view the range
// is unmapped; Map takes the pages back with no Allocate and no driver
// call; a reclaim asks a session with standby pages first and
// ReleasePages gives them first. One FREE with the standby flag, all or
// nothing: on error nothing changes. Where the daemon does not offer
// standby pages (Info.FDChannelStandby false) it is Unmap.
func (r *Region) UnmapStandby(ctx context.Context, off, length uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	first, end, err := r.pagesOf("Region.UnmapStandby", off, length, true)
	if err != nil {
		return err
	}
	return r.standbyLocked(ctx, first, end)
}

func (r *Region) standbyLocked(ctx context.Context, first, end int) error {
	if !r.p.standbyOK() {
		return r.unmapLocked(ctx, first, end, true)
	}
	var idx []int
	for i := first; i < end; i++ {
		if r.slots[i].live() {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return nil
	}
	ids := make([]uint64, len(idx))
	for k, i := range idx {
		ids[k] = r.slots[i].id
	}
	if err := r.p.standbyPages(ctx, ids); err != nil {
		return err
	}
	r.setStandby(idx, true)
	return nil
}

// Grow makes sure [0, n) is mapped (n rounded up to a page).
func (r *Region) Grow(ctx context.Context, n uint64) error { return r.Map(ctx, 0, n) }

// Trim unmaps and frees every page beyond the first n bytes (n rounded up
// to a page), keeping [0, n).
func (r *Region) Trim(ctx context.Context, n uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return newError(ErrClosed, "Region.Trim", "region is closed")
	}
	if n > r.size {
		n = r.size
	}
	return r.unmapLocked(ctx, int((n+r.page-1)/r.page), len(r.slots), true)
}

// TrimStandby is Trim that keeps the pages beyond the first n bytes mapped
// as standby (see UnmapStandby), keeping [0, n) in use.
func (r *Region) TrimStandby(ctx context.Context, n uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return newError(ErrClosed, "Region.TrimStandby", "region is closed")
	}
	if n > r.size {
		n = r.size
	}
	return r.standbyLocked(ctx, int((n+r.page-1)/r.page), len(r.slots))
}

// ReleasePages answers a reclaim request (a ReclaimHandler's helper): it
// unmaps and frees up to pages pages in one Free, standby pages first
// (from the region's end), then pages in use from the end of the region,
// never one of the first keepBytes (rounded up to a page; standby pages
// there are given all the same: nobody uses them). It returns the pages
// given back.
func (r *Region) ReleasePages(ctx context.Context, pages int, keepBytes uint64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, newError(ErrClosed, "Region.ReleasePages", "region is closed")
	}
	var idx []int
	for i := len(r.slots) - 1; i >= 0 && len(idx) < pages; i-- {
		if r.slots[i].standby {
			idx = append(idx, i)
		}
	}
	floor := int(min((keepBytes+r.page-1)/r.page, uint64(len(r.slots))))
	for i := len(r.slots) - 1; i >= floor && len(idx) < pages; i-- {
		if r.slots[i].live() {
			idx = append(idx, i)
		}
	}
	return r.unmapSlotsLocked(ctx, idx, true)
}

func (r *Region) addr(i int) uintptr { return r.base + uintptr(uint64(i)*r.page) }

func (r *Region) checkMapped(op string, off uint64, n int) error {
	first, end, err := r.pagesOf(op, off, uint64(n), false)
	if err != nil {
		return err
	}
	for i := first; i < end; i++ {
		if !r.slots[i].live() {
			return newError(ErrNotMapped, op, "page %d (offset %d) is not mapped", i, uint64(i)*r.page)
		}
	}
	return nil
}

// WriteAt copies p into the region at off (io.WriterAt). Every page it
// touches must be mapped. For CUDA this is a host-to-device copy.
func (r *Region) WriteAt(p []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if off < 0 {
		return 0, newError(ErrInvalidArgument, "Region.WriteAt", "negative offset")
	}
	if err := r.checkMapped("Region.WriteAt", uint64(off), len(p)); err != nil {
		return 0, err
	}
	if err := r.m.write(r.base+uintptr(off), p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// ReadAt copies from the region at off into p (io.ReaderAt).
func (r *Region) ReadAt(p []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if off < 0 {
		return 0, newError(ErrInvalidArgument, "Region.ReadAt", "negative offset")
	}
	if err := r.checkMapped("Region.ReadAt", uint64(off), len(p)); err != nil {
		return 0, err
	}
	if err := r.m.read(r.base+uintptr(off), p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Close unmaps and frees every page (standby ones included) and releases
// the reservation.
func (r *Region) Close(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	err := r.unmapLocked(ctx, 0, len(r.slots), true)
	err = errors.Join(err, r.releaseLocked())
	r.mu.Unlock()
	r.p.forget(r)
	return err
}

// release is Session.Close's path: unmap everything; with free false the
// pages are not freed one by one (CloseSession returns them all).
func (r *Region) release(free bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	err := r.unmapLocked(context.Background(), 0, len(r.slots), free)
	return errors.Join(err, r.releaseLocked())
}

func (r *Region) releaseLocked() error {
	r.closed = true
	if r.mapped > 0 {
		return newError(ErrMapping, "Region.Close", "%d pages could not be unmapped; the reservation is kept", r.mapped)
	}
	return r.m.release(r.base, r.size)
}
