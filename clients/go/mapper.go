package kvcached

import "os"

// mapper maps pages of one device kind into this process. Region uses only
// this interface, so host and CUDA pages behave the same above it (the
// Python client has the same split: kvcached_service/client/mapping.py).
// A session makes one mapper per device, with the backend that
// mapperBackends names for the device's kind.
type mapper interface {
	// reserve size bytes of address space (no memory behind it).
	reserve(size uint64) (uintptr, error)
	// release a reservation; everything in it must be unmapped.
	release(base uintptr, size uint64) error
	// mapRun maps the pages of run (each of size bytes) at addr,
	// addr+size, ... (inside a reservation), all or nothing, and closes every
	// file, on success and on failure. One call per run of adjacent pages:
	// the CUDA mapper sets access for the run with one cuMemSetAccess, and
	// maps a page whose handle the session kept without an import
	// (keptHandles).
	mapRun(addr uintptr, run pageRun, size uint64) error
	// unmap unmaps [addr, addr+size): one page, or a run of adjacent pages
	// (whole mappings, as mapRun made them) with one call (CUDA: one
	// cuMemUnmap over the run's mappings); the range stays reserved.
	// Region unmaps each run of adjacent pages it gives back with one call,
	// and a run refused page by page.
	unmap(addr uintptr, size uint64) error
	// write and read copy bytes to and from mapped memory.
	write(addr uintptr, p []byte) error
	read(addr uintptr, p []byte) error
	close()
}

// pageRun is what mapRun maps: the pages' descriptors, and (when known)
// their ids and the fd channel generation they came on, which the CUDA
// mapper's cache of kept handles needs.
type pageRun struct {
	files []*os.File
	ids   []uint64 // nil: unknown (nothing is kept or mapped from a kept handle)
	gen   uint64
}

// mapperBackends is the one place that maps a device kind (Device.Kind, as
// the daemon's GetInfo reports it) to the backend that maps its pages. A
// new backend is a mapper in a file of its own and one line here.
var mapperBackends = map[string]func(dev Device, kept *keptHandles) (mapper, error){
	"host": newHostMapper, // mapper_host.go: memfd pages, mmap
	"cuda": newCUDAMapper, // mapper_cuda.go: CUDA VMM through internal/cuda
}

// newMapper makes the mapper for the pages of dev; kept is the session's
// cache of kept handles (used by the CUDA mapper).
func newMapper(dev Device, kept *keptHandles) (mapper, error) {
	open, ok := mapperBackends[dev.Kind]
	if !ok {
		return nil, newError(ErrInvalidArgument, "NewRegion", "device %s has unknown kind %q", dev.UUID, dev.Kind)
	}
	return open(dev, kept)
}

// mapEach is mapRun for a mapper that maps page by page (mapPage closes its
// file in every case): all or nothing, every file closed.
func mapEach(mapPage func(uintptr, *os.File, uint64) error, unmap func(uintptr, uint64) error,
	addr uintptr, files []*os.File, size uint64) error {
	for i, f := range files {
		if err := mapPage(addr+uintptr(uint64(i)*size), f, size); err != nil {
			for _, rest := range files[i+1:] {
				_ = rest.Close()
			}
			if i > 0 {
				_ = unmap(addr, uint64(i)*size) // the pages mapped so far: one run
			}
			return err
		}
	}
	return nil
}
