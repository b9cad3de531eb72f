package kvcached

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func memfdPage(t *testing.T, size int64) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("page", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	return os.NewFile(uintptr(fd), "page")
}
