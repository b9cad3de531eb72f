//go:build cgo

// Package cuda is the client's whole binding to the CUDA driver: the few
// driver API functions a client needs to map daemon pages, loaded with
// dlopen at run time (KVCACHED_LIBCUDA, default libcuda.so.1). Nothing from
// CUDA is needed at build time, so a binary built without CUDA runs
// anywhere and uses CUDA where it is present.
//
// The driver's current context is per OS thread, and goroutines move
// between threads, so every operation is one C call that makes the
// device's primary context current and then does its work.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The CUDA types this binding needs, declared as in NVIDIA's cuda.h.
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { int type; int id; } CUmemLocation;          // CUmemLocationType, id
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc; // CUmemAccess_flags
enum { KVC_CU_MEM_LOCATION_TYPE_DEVICE = 1, KVC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
       KVC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 };

// One row per driver function: the C prototype, then the table entry.
typedef struct {
	void *lib;
	// CUresult cuInit(unsigned int Flags);
	CUresult (*cuInit)(unsigned int);
	// CUresult cuDeviceGetCount(int *count);
	CUresult (*cuDeviceGetCount)(int *);
	// CUresult cuDeviceGet(CUdevice *device, int ordinal);
	CUresult (*cuDeviceGet)(CUdevice *, int);
	// CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
	CUresult (*cuDeviceGetUuid_v2)(CUuuid *, CUdevice);
	// CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	// CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);   (the header maps cuDevicePrimaryCtxRelease to it)
	CUresult (*cuDevicePrimaryCtxRelease_v2)(CUdevice);
	// CUresult cuCtxSetCurrent(CUcontext ctx);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	// CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
	CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	// CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
	CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
	// CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType);
	CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
	// CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
	CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	// CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
	CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	// CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
	CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
	// CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
	CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
	// CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
	CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void *, size_t);
	// CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
	CUresult (*cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
	// CUresult cuGetErrorName(CUresult error, const char **pStr);
	CUresult (*cuGetErrorName)(CUresult, const char **);
} kvc_cuda;

// kvc_cuda_load fills the table; returns 0, or -1 with a message in err.
static int kvc_cuda_load(kvc_cuda *t, const char *path, char *err, size_t errlen) {
	memset(t, 0, sizeof *t);
	t->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!t->lib) {
		snprintf(err, errlen, "dlopen(%s): %s", path, dlerror());
		return -1;
	}
#define KVC_SYM(name) do { \
		*(void **)(&t->name) = dlsym(t->lib, #name); \
		if (!t->name) { snprintf(err, errlen, "%s: symbol %s not found", path, #name); dlclose(t->lib); t->lib = NULL; return -1; } \
	} while (0)
	KVC_SYM(cuInit); KVC_SYM(cuDeviceGetCount); KVC_SYM(cuDeviceGet); KVC_SYM(cuDeviceGetUuid_v2);
	KVC_SYM(cuDevicePrimaryCtxRetain); KVC_SYM(cuDevicePrimaryCtxRelease_v2); KVC_SYM(cuCtxSetCurrent);
	KVC_SYM(cuMemAddressReserve); KVC_SYM(cuMemAddressFree); KVC_SYM(cuMemImportFromShareableHandle);
	KVC_SYM(cuMemMap); KVC_SYM(cuMemSetAccess); KVC_SYM(cuMemRelease); KVC_SYM(cuMemUnmap);
	KVC_SYM(cuMemcpyHtoD_v2); KVC_SYM(cuMemcpyDtoH_v2); KVC_SYM(cuGetErrorName);
#undef KVC_SYM
	return 0;
}

static const char *kvc_err_name(kvc_cuda *t, CUresult r) {
	const char *s = NULL;
	if (t->cuGetErrorName(r, &s) != 0 || !s) return "CUDA_ERROR_UNKNOWN";
	return s;
}

// Find the ordinal whose UUID is uuid; retain its primary context.
// *where names the failing call.
static CUresult kvc_open(kvc_cuda *t, const char uuid[16], int *ordinal, CUcontext *ctx, const char **where) {
	CUresult r;
	int n = 0;
	*where = "cuInit";
	if ((r = t->cuInit(0)) != 0) return r;
	*where = "cuDeviceGetCount";
	if ((r = t->cuDeviceGetCount(&n)) != 0) return r;
	for (int i = 0; i < n; i++) {
		CUdevice d; CUuuid u;
		*where = "cuDeviceGet";
		if ((r = t->cuDeviceGet(&d, i)) != 0) return r;
		*where = "cuDeviceGetUuid_v2";
		if ((r = t->cuDeviceGetUuid_v2(&u, d)) != 0) return r;
		if (memcmp(u.bytes, uuid, 16) == 0) {
			*ordinal = d;
			*where = "cuDevicePrimaryCtxRetain";
			return t->cuDevicePrimaryCtxRetain(ctx, d);
		}
	}
	*where = "";
	*ordinal = -1;
	return 0;
}

static CUresult kvc_close(kvc_cuda *t, int dev) { return t->cuDevicePrimaryCtxRelease_v2(dev); }

static CUresult kvc_reserve(kvc_cuda *t, CUcontext ctx, size_t size, size_t align, CUdeviceptr *out, const char **where) {
	CUresult r;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	*where = "cuMemAddressReserve";
	return t->cuMemAddressReserve(out, size, align, 0, 0);
}

static CUresult kvc_free(kvc_cuda *t, CUcontext ctx, CUdeviceptr p, size_t size, const char **where) {
	CUresult r;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	*where = "cuMemAddressFree";
	return t->cuMemAddressFree(p, size);
}

// How kvc_map_run maps page i of a run (modes[i]).
enum { KVC_MAP_IMPORT = 0,      // import fds[i], map, release the imported handle
       KVC_MAP_IMPORT_KEEP = 1, // import fds[i], map, keep the handle: handles[i] = it
       KVC_MAP_KEPT = 2 };      // map handles[i], a handle kept earlier (no import, not released)

// Map each page of a run at p + i*size with offset 0, as modes[i] says (a
// released handle's page stays alive through its mapping); then give dev
// read-write access to the whole run with one cuMemSetAccess. All or
// nothing: on failure nothing of the run stays mapped, and the handles
// this call imported to keep are released (handles[i] = 0 for them); kept
// handles given in stay. The caller closes the fds afterwards.
static CUresult kvc_map_run(kvc_cuda *t, CUcontext ctx, int dev, CUdeviceptr p, size_t size, const int *fds,
                            const unsigned char *modes, CUmemGenericAllocationHandle *handles, size_t n,
                            const char **where) {
	CUresult r;
	size_t mapped = 0;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	for (; mapped < n; mapped++) {
		CUmemGenericAllocationHandle h = 0;
		if (modes[mapped] == KVC_MAP_KEPT) {
			h = handles[mapped];
		} else {
			*where = "cuMemImportFromShareableHandle";
			if ((r = t->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fds[mapped], KVC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) != 0) break;
		}
		*where = "cuMemMap";
		if ((r = t->cuMemMap(p + mapped * size, size, 0, h, 0)) != 0) {
			if (modes[mapped] != KVC_MAP_KEPT) t->cuMemRelease(h);
			break;
		}
		if (modes[mapped] == KVC_MAP_IMPORT_KEEP) {
			handles[mapped] = h;
		} else if (modes[mapped] == KVC_MAP_IMPORT) {
			*where = "cuMemRelease";
			if ((r = t->cuMemRelease(h)) != 0) { mapped++; break; }
		}
	}
	if (r == 0 && n > 0) {
		CUmemAccessDesc d;
		memset(&d, 0, sizeof d);
		d.location.type = KVC_CU_MEM_LOCATION_TYPE_DEVICE;
		d.location.id = dev;
		d.flags = KVC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
		*where = "cuMemSetAccess";
		if ((r = t->cuMemSetAccess(p, n * size, &d, 1)) == 0) return 0;
	}
	for (size_t i = 0; i < mapped; i++) t->cuMemUnmap(p + i * size, size);
	for (size_t i = 0; i < mapped; i++) {
		if (modes[i] == KVC_MAP_IMPORT_KEEP) { t->cuMemRelease(handles[i]); handles[i] = 0; }
	}
	return r;
}

// Release handles[0..n) (kept handles); every one is released, the first
// failure is returned.
static CUresult kvc_release(kvc_cuda *t, CUcontext ctx, const CUmemGenericAllocationHandle *handles, size_t n,
                            const char **where) {
	CUresult r, first = 0;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	for (size_t i = 0; i < n; i++) {
		if ((r = t->cuMemRelease(handles[i])) != 0 && first == 0) {
			first = r;
			*where = "cuMemRelease";
		}
	}
	return first;
}

static CUresult kvc_unmap(kvc_cuda *t, CUcontext ctx, CUdeviceptr p, size_t size, const char **where) {
	CUresult r;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	*where = "cuMemUnmap";
	return t->cuMemUnmap(p, size);
}

static CUresult kvc_htod(kvc_cuda *t, CUcontext ctx, CUdeviceptr dst, const void *src, size_t n, const char **where) {
	CUresult r;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	*where = "cuMemcpyHtoD_v2";
	return t->cuMemcpyHtoD_v2(dst, src, n);
}

static CUresult kvc_dtoh(kvc_cuda *t, CUcontext ctx, void *dst, CUdeviceptr src, size_t n, const char **where) {
	CUresult r;
	*where = "cuCtxSetCurrent";
	if ((r = t->cuCtxSetCurrent(ctx)) != 0) return r;
	*where = "cuMemcpyDtoH_v2";
	return t->cuMemcpyDtoH_v2(dst, src, n);
}
*/
import "C"

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"unsafe"
)

// ErrNoDriver: the driver library could not be loaded.
var ErrNoDriver = errors.New("CUDA driver not loadable")

// ErrNoDevice: no visible device has the UUID.
var ErrNoDevice = errors.New("no CUDA device with that UUID")

// Error is a failed driver call.
type Error struct {
	Call string // the driver function
	Code int    // CUresult
	Name string // cuGetErrorName, e.g. "CUDA_ERROR_OUT_OF_MEMORY"
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code) }

// Available is true in builds with cgo.
const Available = true

var (
	loadOnce sync.Once
	table    *C.kvc_cuda
	loadErr  error
)

// LibraryPath is KVCACHED_LIBCUDA or libcuda.so.1.
func LibraryPath() string {
	if p := os.Getenv("KVCACHED_LIBCUDA"); p != "" {
		return p
	}
	return "libcuda.so.1"
}

func load() (*C.kvc_cuda, error) {
	loadOnce.Do(func() {
		t := (*C.kvc_cuda)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvc_cuda{}))))
		path := C.CString(LibraryPath())
		defer C.free(unsafe.Pointer(path))
		var msg [512]C.char
		if C.kvc_cuda_load(t, path, &msg[0], C.size_t(len(msg))) != 0 {
			C.free(unsafe.Pointer(t))
			loadErr = fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&msg[0]))
			return
		}
		table = t // kept for the life of the process, like the driver
	})
	return table, loadErr
}

func check(t *C.kvc_cuda, r C.CUresult, where *C.char) error {
	if r == 0 {
		return nil
	}
	return &Error{Call: C.GoString(where), Code: int(r), Name: C.GoString(C.kvc_err_name(t, r))}
}

// ParseUUID turns "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" into 16 bytes.
func ParseUUID(s string) ([16]byte, error) {
	var u [16]byte
	h := strings.ReplaceAll(strings.TrimPrefix(s, "GPU-"), "-", "")
	b, err := hex.DecodeString(h)
	if err != nil || len(b) != 16 {
		return u, fmt.Errorf("bad CUDA device UUID %q", s)
	}
	copy(u[:], b)
	return u, nil
}

// Device is one device's primary context, retained.
type Device struct {
	t       *C.kvc_cuda
	ctx     C.CUcontext
	ordinal int
	uuid    string
}

// Open finds the device with this UUID among the devices this process sees
// and retains its primary context.
func Open(uuid string) (*Device, error) {
	u, err := ParseUUID(uuid)
	if err != nil {
		return nil, err
	}
	t, err := load()
	if err != nil {
		return nil, err
	}
	var ord C.int
	var ctx C.CUcontext
	var where *C.char
	if err := check(t, C.kvc_open(t, (*C.char)(unsafe.Pointer(&u[0])), &ord, &ctx, &where), where); err != nil {
		return nil, err
	}
	if ord < 0 {
		return nil, fmt.Errorf("%w: %s (CUDA_VISIBLE_DEVICES=%q)", ErrNoDevice, uuid, os.Getenv("CUDA_VISIBLE_DEVICES"))
	}
	return &Device{t: t, ctx: ctx, ordinal: int(ord), uuid: uuid}, nil
}

// Ordinal is this process's ordinal of the device.
func (d *Device) Ordinal() int { return d.ordinal }

// Close releases the primary context.
func (d *Device) Close() error {
	var where = C.CString("cuDevicePrimaryCtxRelease_v2")
	defer C.free(unsafe.Pointer(where))
	return check(d.t, C.kvc_close(d.t, C.int(d.ordinal)), where)
}

// Reserve reserves size bytes of device address space.
func (d *Device) Reserve(size, align uint64) (uint64, error) {
	var p C.CUdeviceptr
	var where *C.char
	if err := check(d.t, C.kvc_reserve(d.t, d.ctx, C.size_t(size), C.size_t(align), &p, &where), where); err != nil {
		return 0, err
	}
	return uint64(p), nil
}

// Free gives a reservation back.
func (d *Device) Free(p, size uint64) error {
	var where *C.char
	return check(d.t, C.kvc_free(d.t, d.ctx, C.CUdeviceptr(p), C.size_t(size), &where), where)
}

// MapRun maps the pages behind fds (each of size bytes) at p, p+size, ...,
// with one cuMemSetAccess for the run: each imported, mapped, and its
// imported handle released. All or nothing; the fds stay open (the caller
// closes them).
func (d *Device) MapRun(p, size uint64, fds []int) error {
	return d.MapRunKept(p, size, fds, make([]MapMode, len(fds)), make([]Handle, len(fds)))
}

// Handle is an imported allocation handle (CUmemGenericAllocationHandle)
// that the caller keeps, to map its page again without an import.
type Handle uint64

// MapMode says how MapRunKept maps one page.
type MapMode uint8

const (
	// Import the page's fd, map it, release the imported handle.
	Import MapMode = iota
	// ImportKeep imports the page's fd, maps it and keeps the handle
	// (written to handles[i]: the caller releases it with Release).
	ImportKeep
	// Kept maps handles[i], a handle kept earlier: no import, no release
	// (fds[i] is not used).
	Kept
)

// MapRunKept is MapRun with a mode per page (modes[i], handles[i] for page
// i). All or nothing: on failure nothing of the run stays mapped and the
// handles imported to keep are released (handles[i] = 0); kept handles
// given in stay the caller's. The fds stay open.
func (d *Device) MapRunKept(p, size uint64, fds []int, modes []MapMode, handles []Handle) error {
	n := len(fds)
	if n == 0 {
		return nil
	}
	if len(modes) != n || len(handles) != n {
		return fmt.Errorf("cuda: %d fds, %d modes, %d handles", n, len(modes), len(handles))
	}
	cfds := make([]C.int, n)
	cmodes := make([]C.uchar, n)
	chandles := make([]C.CUmemGenericAllocationHandle, n)
	for i := range fds {
		cfds[i], cmodes[i], chandles[i] = C.int(fds[i]), C.uchar(modes[i]), C.CUmemGenericAllocationHandle(handles[i])
	}
	var where *C.char
	err := check(d.t, C.kvc_map_run(d.t, d.ctx, C.int(d.ordinal), C.CUdeviceptr(p), C.size_t(size), &cfds[0], &cmodes[0],
		&chandles[0], C.size_t(n), &where), where)
	for i := range handles {
		handles[i] = Handle(chandles[i])
	}
	runtime.KeepAlive(cfds)
	runtime.KeepAlive(cmodes)
	return err
}

// Release releases kept handles (cuMemRelease): every one, returning the
// first failure. A page still mapped stays alive through its mapping.
func (d *Device) Release(handles []Handle) error {
	if len(handles) == 0 {
		return nil
	}
	ch := make([]C.CUmemGenericAllocationHandle, len(handles))
	for i, h := range handles {
		ch[i] = C.CUmemGenericAllocationHandle(h)
	}
	var where *C.char
	err := check(d.t, C.kvc_release(d.t, d.ctx, &ch[0], C.size_t(len(ch)), &where), where)
	runtime.KeepAlive(ch)
	return err
}

// Unmap unmaps [p, p+size) with one cuMemUnmap: one mapping, or several
// whole adjacent ones (a run of pages).
func (d *Device) Unmap(p, size uint64) error {
	var where *C.char
	return check(d.t, C.kvc_unmap(d.t, d.ctx, C.CUdeviceptr(p), C.size_t(size), &where), where)
}

// CopyToDevice copies src to device address dst.
func (d *Device) CopyToDevice(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	var where *C.char
	err := check(d.t, C.kvc_htod(d.t, d.ctx, C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)), &where), where)
	runtime.KeepAlive(src)
	return err
}

// CopyFromDevice copies from device address src into dst.
func (d *Device) CopyFromDevice(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	var where *C.char
	err := check(d.t, C.kvc_dtoh(d.t, d.ctx, unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)), &where), where)
	runtime.KeepAlive(dst)
	return err
}
