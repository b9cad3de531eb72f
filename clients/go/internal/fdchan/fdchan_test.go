package fdchan

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Byte vectors written by hand from the tables in docs/protocol.md.
var secret = func() (s [32]byte) {
	for i := range s {
		s[i] = byte(i)
	}
	return
}()

const helloHex = `4b564346 0100 0100 38000000 00000000
	0807060504030201 e8030000 e9030000 ea030000 fd000000
	000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f`

const pagesHex = `4b564346 0100 0200 28000000 00000000
	0900000000000000 05000000 02000000 07000000 00000000
	1100000000000000 2200000000000000`

const adoptHex = `4b564346 0100 0500 28000000 00000000
	0900000000000000 05000000 02000000 07000000 00000000
	1100000000000000 2200000000000000`

const errorHex = `4b564346 0100 0300 09000000 00000000 08000000 66756c6c21`

const goodbyeHex = `4b564346 0100 0400 00000000 00000000`

func TestVectors(t *testing.T) {
	cases := []struct {
		name string
		hex  string
		rec  Record
		nfds int
	}{
		{"hello", helloHex, Hello{ChannelID: 0x0102030405060708, PID: 1000, UID: 1001, GID: 1002, MaxFDs: 253, Secret: secret}, 0},
		{"pages", pagesHex, Pages{AllocationID: 9, FirstIndex: 5, Total: 7, PageIDs: []uint64{0x11, 0x22}}, 2},
		{"adopt", adoptHex, Adopt{SessionID: 9, FirstIndex: 5, Total: 7, PageIDs: []uint64{0x11, 0x22}}, 2},
		{"error", errorHex, Error{Code: 8, Message: "full!"}, 0},
		{"goodbye", goodbyeHex, Goodbye{}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := unhex(t, c.hex)
			if got := Encode(c.rec); !bytes.Equal(got, want) {
				t.Fatalf("Encode:\n got %x\nwant %x", got, want)
			}
			got, err := Decode(want, c.nfds)
			if err != nil {
				t.Fatal(err)
			}
			if !equalRecord(got, c.rec) {
				t.Fatalf("Decode: got %#v want %#v", got, c.rec)
			}
		})
	}
}

func equalRecord(a, b Record) bool {
	if x, ok := a.(Adopt); ok {
		a = Pages{AllocationID: x.SessionID, FirstIndex: x.FirstIndex, Total: x.Total, PageIDs: x.PageIDs}
		y, ok := b.(Adopt)
		if !ok {
			return false
		}
		b = Pages{AllocationID: y.SessionID, FirstIndex: y.FirstIndex, Total: y.Total, PageIDs: y.PageIDs}
	}
	pa, oka := a.(Pages)
	pb, okb := b.(Pages)
	if oka || okb {
		if !(oka && okb) || pa.AllocationID != pb.AllocationID || pa.FirstIndex != pb.FirstIndex || pa.Total != pb.Total || len(pa.PageIDs) != len(pb.PageIDs) {
			return false
		}
		for i := range pa.PageIDs {
			if pa.PageIDs[i] != pb.PageIDs[i] {
				return false
			}
		}
		return true
	}
	return a == b
}

func TestDecodeRejects(t *testing.T) {
	hello := unhex(t, helloHex)
	pages := unhex(t, pagesHex)
	mut := func(b []byte, off int, v byte) []byte {
		c := append([]byte(nil), b...)
		c[off] = v
		return c
	}
	cases := []struct {
		name string
		data []byte
		nfds int
	}{
		{"short", hello[:10], 0},
		{"magic", mut(hello, 0, 'X'), 0},
		{"version", mut(hello, 4, 2), 0},
		{"length-mismatch", hello[:len(hello)-1], 0},
		{"length-field", mut(hello, 8, 57), 0},
		{"hello-with-fds", hello, 1},
		{"pages-fd-count", pages, 1},
		{"pages-count-zero", mut(pages, HeaderSize+12, 0), 0},
		{"pages-beyond-total", mut(pages, HeaderSize+16, 3), 2},
		{"unknown-type", mut(unhex(t, goodbyeHex), 6, 9), 0},
		{"goodbye-with-fds", unhex(t, goodbyeHex), 1},
		{"error-short", unhex(t, `4b564346 0100 0300 02000000 00000000 0800`), 0},
	}
	for _, c := range cases {
		if _, err := Decode(c.data, c.nfds); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: got %v, want ErrProtocol", c.name, err)
		}
	}
}

// The daemon's own encoder (kvcached_service/fdchannel.py) must produce the
// same bytes as ours.
func TestMatchesPythonEncoder(t *testing.T) {
	repo, _ := filepath.Abs("../../../..")
	py := filepath.Join(repo, ".venv", "bin", "python")
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("%s not found (run scripts/setup.sh): %v", py, err)
	}
	script := `
import sys
from kvcached_service import fdchannel as f
print(f.encode_hello(f.Hello(0x0102030405060708, 1000, 1001, 1002, 253, bytes(range(32)))).hex())
print(f.encode_pages(9, 5, 7, [0x11, 0x22]).hex())
print(f.encode_error(8, "full!").hex())
print(f.encode_goodbye().hex())
print(f.encode_adopt(9, 5, 7, [0x11, 0x22]).hex())
`
	cmd := exec.Command(py, "-c", script)
	cmd.Dir = repo
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	lines := strings.Fields(string(out))
	for i, h := range []string{helloHex, pagesHex, errorHex, goodbyeHex, adoptHex} {
		if want := hex.EncodeToString(unhex(t, h)); i >= len(lines) || lines[i] != want {
			t.Errorf("record %d: python %v, Go vector %s", i, lines, want)
		}
	}
}

func socketPair(t *testing.T) (*Conn, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "client")
	nc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[1]) })
	return NewConn(nc.(*net.UnixConn)), fds[1]
}

func TestConnRecvWithFDs(t *testing.T) {
	c, peer := socketPair(t)
	defer c.Close()
	if err := unix.Sendmsg(peer, Encode(Hello{ChannelID: 1, MaxFDs: 253, Secret: secret}), nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	memfd, err := unix.MemfdCreate("page", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(memfd)
	if err := unix.Sendmsg(peer, Encode(Pages{AllocationID: 3, Total: 1, PageIDs: []uint64{42}}), unix.UnixRights(memfd), nil, 0); err != nil {
		t.Fatal(err)
	}
	// A malformed record with an fd: the fd must be closed, not leaked.
	if err := unix.Sendmsg(peer, Encode(Goodbye{}), unix.UnixRights(memfd), nil, 0); err != nil {
		t.Fatal(err)
	}
	r, err := c.Recv()
	if h, ok := r.(Hello); err != nil || !ok || h.Secret != secret {
		t.Fatalf("hello: %#v %v", r, err)
	}
	r, err = c.Recv()
	p, ok := r.(Pages)
	if err != nil || !ok || len(p.FDs) != 1 || p.PageIDs[0] != 42 {
		t.Fatalf("pages: %#v %v", r, err)
	}
	flags, err := unix.FcntlInt(uintptr(p.FDs[0]), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Errorf("received fd is not close-on-exec: flags %d err %v", flags, err)
	}
	unix.Close(p.FDs[0])
	if _, err := c.Recv(); !errors.Is(err, ErrProtocol) {
		t.Fatalf("goodbye with fd: %v", err)
	}
	unix.Close(peer)
	r, err = c.Recv()
	if r != nil || !errors.Is(err, io.EOF) {
		t.Fatalf("end of stream: %#v %v", r, err)
	}
}

// SendAdopt splits a claim into records of at most MaxFDs descriptors,
// each arriving with its own fds, in order.
func TestSendAdopt(t *testing.T) {
	c, peer := socketPair(t)
	defer c.Close()
	const n = MaxFDs + 7
	memfd, err := unix.MemfdCreate("page", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(memfd)
	ids := make([]uint64, n)
	fds := make([]int, n)
	for i := range ids {
		ids[i], fds[i] = uint64(100+i), memfd
	}
	if err := c.SendAdopt(77, ids, fds, time.Now().Add(5*time.Second)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, MaxRecord)
	oob := make([]byte, unix.CmsgSpace(MaxFDs*4))
	next := 0
	for _, want := range []int{MaxFDs, 7} {
		nb, noob, _, _, err := unix.Recvmsg(peer, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		got, err := parseRights(oob[:noob])
		if err != nil {
			t.Fatal(err)
		}
		closeAll(got)
		r, err := Decode(buf[:nb], len(got))
		a, ok := r.(Adopt)
		if err != nil || !ok || len(got) != want || a.SessionID != 77 || a.Total != n || int(a.FirstIndex) != next || a.PageIDs[0] != uint64(100+next) {
			t.Fatalf("record at %d: %#v (%d fds) %v", next, r, len(got), err)
		}
		next += want
	}
	if err := c.SendAdopt(77, ids[:1], nil, time.Time{}); err == nil {
		t.Fatal("ids and fds of different lengths accepted")
	}
}
