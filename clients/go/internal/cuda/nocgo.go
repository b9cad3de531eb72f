//go:build !cgo

package cuda

import (
	"errors"
	"fmt"
	"os"
)

// ErrNoDriver: the driver library could not be loaded (always, without cgo).
var ErrNoDriver = errors.New("CUDA driver not loadable")

// ErrNoDevice: no visible device has the UUID.
var ErrNoDevice = errors.New("no CUDA device with that UUID")

// Error is a failed driver call.
type Error struct {
	Call string
	Code int
	Name string
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code) }

// Available is false: this build has no cgo, so no dlopen.
const Available = false

// LibraryPath is KVCACHED_LIBCUDA or libcuda.so.1.
func LibraryPath() string {
	if p := os.Getenv("KVCACHED_LIBCUDA"); p != "" {
		return p
	}
	return "libcuda.so.1"
}

// Handle is an imported allocation handle the caller keeps.
type Handle uint64

// MapMode says how MapRunKept maps one page.
type MapMode uint8

// The modes of MapRunKept.
const (
	Import MapMode = iota
	ImportKeep
	Kept
)

// Device is never opened in a build without cgo.
type Device struct{}

// Open always fails without cgo.
func Open(uuid string) (*Device, error) {
	return nil, fmt.Errorf("%w: built without cgo (CGO_ENABLED=0)", ErrNoDriver)
}

func (d *Device) Ordinal() int                               { return -1 }
func (d *Device) Close() error                               { return ErrNoDriver }
func (d *Device) Reserve(size, align uint64) (uint64, error) { return 0, ErrNoDriver }
func (d *Device) Free(p, size uint64) error                  { return ErrNoDriver }
func (d *Device) MapRun(p, size uint64, fds []int) error     { return ErrNoDriver }
func (d *Device) Release(handles []Handle) error             { return ErrNoDriver }
func (d *Device) Unmap(p, size uint64) error                 { return ErrNoDriver }
func (d *Device) CopyToDevice(dst uint64, src []byte) error  { return ErrNoDriver }
func (d *Device) CopyFromDevice(dst []byte, src uint64) error {
	return ErrNoDriver
}

// MapRunKept always fails without cgo.
func (d *Device) MapRunKept(p, size uint64, fds []int, modes []MapMode, handles []Handle) error {
	return ErrNoDriver
}
