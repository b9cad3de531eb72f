package kvcached

import (
	"errors"
	"fmt"

	"github.com/kvcached/kvcached-service/clients/go/internal/cuda"
)

// cudaMapper maps CUDA pages: import the fd (by value), cuMemMap at offset 0
// into our own reservation, cuMemRelease the imported handle, close the fd;
// then one cuMemSetAccess for our ordinal over the run of pages mapped
// together; unmapping is one cuMemUnmap per page or run of adjacent pages
// unmapped together. With the session's cache of kept handles (keptHandles,
// docs/protocol.md "Kept handles") a page whose handle the session kept is
// mapped from it (the fd is closed, nothing imported or released), and an
// imported handle is kept instead of released while the cache has room.
// The driver is loaded with dlopen (KVCACHED_LIBCUDA, default
// libcuda.so.1) the first time it is needed.
type cudaMapper struct {
	dev  *cuda.Device
	kept *keptHandles // the session's (nil: keep nothing)
}

func newCUDAMapper(dev Device, kept *keptHandles) (mapper, error) {
	d, err := cuda.Open(dev.UUID)
	if err != nil {
		return nil, cudaErr("opening device "+dev.UUID, err)
	}
	return &cudaMapper{dev: d, kept: kept}, nil
}

func cudaErr(what string, err error) error {
	if errors.Is(err, cuda.ErrNoDriver) || errors.Is(err, cuda.ErrNoDevice) {
		return newError(ErrNoCUDA, "cuda", "%s: %v (KVCACHED_LIBCUDA=%q)", what, err, cuda.LibraryPath())
	}
	return newError(ErrMapping, "cuda", "%s: %v", what, err)
}

func (m *cudaMapper) reserve(size uint64) (uintptr, error) {
	p, err := m.dev.Reserve(size, 0)
	if err != nil {
		return 0, cudaErr("reserving device address space", err)
	}
	return uintptr(p), nil
}

func (m *cudaMapper) release(base uintptr, size uint64) error {
	if err := m.dev.Free(uint64(base), size); err != nil {
		return cudaErr("freeing a reservation", err)
	}
	return nil
}

func (m *cudaMapper) mapRun(addr uintptr, run pageRun, size uint64) error {
	fds := make([]int, len(run.files))
	for i, f := range run.files {
		defer f.Close()
		fds[i] = int(f.Fd())
	}
	var err error
	if m.kept != nil {
		err = m.kept.mapRun(m.dev, uint64(addr), size, fds, run)
	} else {
		err = m.dev.MapRun(uint64(addr), size, fds)
	}
	if err != nil {
		return cudaErr(fmt.Sprintf("mapping %d page(s)", len(run.files)), err)
	}
	return nil
}

// unmap is one cuMemUnmap over [addr, addr+size): a page or a run of
// adjacent pages (the driver unmaps a range made of several whole
// mappings in one call). Nothing is kept per address: kept handles are by
// page id.
func (m *cudaMapper) unmap(addr uintptr, size uint64) error {
	if err := m.dev.Unmap(uint64(addr), size); err != nil {
		return cudaErr(fmt.Sprintf("unmapping %d bytes", size), err)
	}
	return nil
}

func (m *cudaMapper) write(addr uintptr, p []byte) error {
	if err := m.dev.CopyToDevice(uint64(addr), p); err != nil {
		return cudaErr("copying to the device", err)
	}
	return nil
}

func (m *cudaMapper) read(addr uintptr, p []byte) error {
	if err := m.dev.CopyFromDevice(p, uint64(addr)); err != nil {
		return cudaErr("copying from the device", err)
	}
	return nil
}

func (m *cudaMapper) close() { _ = m.dev.Close() }
