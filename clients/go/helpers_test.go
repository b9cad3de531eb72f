package kvcached

import (
	"crypto/sha256"
	"encoding/hex"
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
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

func sha256hex(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// dialChannel connects an fd channel and returns its HELLO secret.
func dialChannel(t *testing.T, path string) (*fdchan.Conn, [32]byte) {
	t.Helper()
	ch, err := fdchan.Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	r, err := ch.Recv()
	h, ok := r.(fdchan.Hello)
	if err != nil || !ok {
		t.Fatalf("HELLO: %#v %v", r, err)
	}
	return ch, h.Secret
}

// unixListenAndClose leaves a socket file behind with no listener.
func unixListenAndClose(path string) (string, error) {
	l, err := net.Listen("unix", path)
	if err != nil {
		return "", err
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	return path, l.Close()
}
