package kvcached

import (
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// hostMapper maps memfd pages: a reservation is a PROT_NONE anonymous
// mapping; a page is mapped over its slot with MAP_FIXED|MAP_SHARED and
// unmapped by putting PROT_NONE anonymous memory back (one mmap over a
// page or a run of adjacent pages).
type hostMapper struct{}

func newHostMapper(Device, *keptHandles) (mapper, error) { return hostMapper{}, nil }

// ptr turns an address we got from mmap back into a pointer. The memory is
// outside the Go heap, so the GC does not care.
func ptr(addr uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&addr)) }

func mappingErr(what string, err error) error {
	return newError(ErrMapping, "mmap", "%s: %v", what, err)
}

func (hostMapper) reserve(size uint64) (uintptr, error) {
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, mappingErr("reserving address space", err)
	}
	return uintptr(p), nil
}

func (hostMapper) release(base uintptr, size uint64) error {
	if err := unix.MunmapPtr(ptr(base), uintptr(size)); err != nil {
		return mappingErr("releasing a reservation", err)
	}
	return nil
}

// mapRun maps page by page (mmap costs the same); host pages are never
// kept (a mapping costs one mmap either way).
func (m hostMapper) mapRun(addr uintptr, run pageRun, size uint64) error {
	return mapEach(m.mapPage, m.unmap, addr, run.files, size)
}

func (hostMapper) mapPage(addr uintptr, f *os.File, size uint64) error {
	defer f.Close()
	got, err := unix.MmapPtr(int(f.Fd()), 0, ptr(addr), uintptr(size), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil {
		return mappingErr("mapping a page", err)
	}
	if uintptr(got) != addr {
		return mappingErr("mapping a page", unix.EFAULT)
	}
	return nil
}

func (hostMapper) unmap(addr uintptr, size uint64) error {
	_, err := unix.MmapPtr(-1, 0, ptr(addr), uintptr(size), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE)
	if err != nil {
		return mappingErr("unmapping pages", err)
	}
	return nil
}

func (hostMapper) write(addr uintptr, p []byte) error {
	copy(unsafe.Slice((*byte)(ptr(addr)), len(p)), p)
	return nil
}

func (hostMapper) read(addr uintptr, p []byte) error {
	copy(p, unsafe.Slice((*byte)(ptr(addr)), len(p)))
	return nil
}

func (hostMapper) close() {}
