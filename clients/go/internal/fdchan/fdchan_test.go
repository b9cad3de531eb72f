package fdchan

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
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

// Requests on the channel and their answer ("Requests on the channel" in
// docs/protocol.md).
const allocateHex = `4b564346 0100 0600 1e000000 00000000
	0500000000000000 03000000 03000000 fa000000 06000000 484f53542d30`

const freeHex = `4b564346 0100 0700 20000000 00000000
	0600000000000000 02000000 00000000 1100000000000000 2200000000000000`

const closeHex = `4b564346 0100 0800 08000000 00000000 0700000000000000`

const replyHex = `4b564346 0100 0900 1d000000 00000000
	0500000000000000 08000000 00000000 0000100000000000 66756c6c21`

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
		{"allocate", allocateHex, AllocateReq{ReqID: 5, NumPages: 3, Wait: true, Notify: true, WaitTimeoutMs: 250, Device: "HOST-0"}, 0},
		{"free", freeHex, FreeReq{ReqID: 6, PageIDs: []uint64{0x11, 0x22}}, 0},
		{"close", closeHex, CloseReq{ReqID: 7}, 0},
		{"reply", replyHex, Reply{ReqID: 5, Code: 8, Value: 0x100000, Message: "full!"}, 0},
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
	if x, ok := a.(FreeReq); ok {
		y, ok := b.(FreeReq)
		return ok && x.ReqID == y.ReqID && fmt.Sprint(x.PageIDs) == fmt.Sprint(y.PageIDs)
	}
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
		{"unknown-type", mut(unhex(t, goodbyeHex), 6, 0), 0},
		{"goodbye-with-fds", unhex(t, goodbyeHex), 1},
		{"error-short", unhex(t, `4b564346 0100 0300 02000000 00000000 0800`), 0},
		{"allocate-device-length", mut(unhex(t, allocateHex), HeaderSize+20, 7), 0},
		{"allocate-short", unhex(t, `4b564346 0100 0600 04000000 00000000 05000000`), 0},
		{"allocate-with-fds", unhex(t, allocateHex), 1},
		{"free-count", mut(unhex(t, freeHex), HeaderSize+8, 3), 0},
		{"free-short", unhex(t, `4b564346 0100 0700 08000000 00000000 0600000000000000`), 0},
		{"close-size", unhex(t, `4b564346 0100 0800 04000000 00000000 07000000`), 0},
		{"reply-short", unhex(t, `4b564346 0100 0900 10000000 00000000 0500000000000000 0800000000000000`), 0},
		{"reply-with-fds", unhex(t, replyHex), 1},
		{"unknown-type-10", mut(unhex(t, goodbyeHex), 6, 10), 0},
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
print(f.encode_allocate(5, 3, "HOST-0", wait=True, notify=True, wait_timeout_ms=250).hex())
print(f.encode_free(6, [0x11, 0x22]).hex())
print(f.encode_close(7).hex())
print(f.encode_reply(5, 8, 0x100000, "full!").hex())
assert f.CHANNEL_ALLOC_BIT == 1 << 63 and f.MAX_FREE_IDS == 16384 and f.ALLOC_WAIT == 1 and f.ALLOC_NOTIFY == 2
assert (f.REQ_ALLOCATE, f.REQ_FREE, f.REQ_CLOSE, f.REPLY) == (6, 7, 8, 9)
print(f.MAX_RECORD)
`
	cmd := exec.Command(py, "-c", script)
	cmd.Dir = repo
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	lines := strings.Fields(string(out))
	vectors := []string{helloHex, pagesHex, errorHex, goodbyeHex, adoptHex, allocateHex, freeHex, closeHex, replyHex}
	for i, h := range vectors {
		if want := hex.EncodeToString(unhex(t, h)); i >= len(lines) || lines[i] != want {
			t.Errorf("record %d: python %v, Go vector %s", i, lines, want)
		}
	}
	if len(lines) != len(vectors)+1 || lines[len(vectors)] != fmt.Sprint(MaxRecord) {
		t.Errorf("python's MAX_RECORD is %v, Go's MaxRecord %d", lines[len(lines)-1], MaxRecord)
	}
	// And the other way round: the daemon decodes what this package encodes.
	check := `
import sys
from kvcached_service import fdchannel as f
for line in sys.stdin.read().split():
    print(repr(f.decode(bytes.fromhex(line), [])))
`
	recs := []Record{
		AllocateReq{ReqID: AllocBit - 1, NumPages: 1 << 20, WaitTimeoutMs: 1},
		FreeReq{ReqID: 2, PageIDs: []uint64{1<<64 - 1}},
		CloseReq{ReqID: 3},
		FreeReq{ReqID: 4, PageIDs: []uint64{7, 8}, Keep: true},
		DroppedReq{ReqID: 5, PageIDs: []uint64{7, 99}},
	}
	var in strings.Builder
	for _, r := range recs {
		in.WriteString(hex.EncodeToString(Encode(r)) + "\n")
	}
	cmd = exec.Command(py, "-c", check)
	cmd.Dir = repo
	cmd.Stdin = strings.NewReader(in.String())
	out, err = cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python decode: %v\n%s", err, out)
	}
	want := "AllocateReq(req_id=9223372036854775807, num_pages=1048576, wait=False, notify=False, wait_timeout_ms=1, device='')\n" +
		"FreeReq(req_id=2, page_ids=(18446744073709551615,), flags=0)\n" +
		"CloseReq(req_id=3)\n" +
		"FreeReq(req_id=4, page_ids=(7, 8), flags=1)\n" +
		"DroppedReq(req_id=5, page_ids=(7, 99))\n"
	if string(out) != want {
		t.Errorf("python decodes Go's requests as\n%s\nwant\n%s", out, want)
	}
}

// A FREE record carries 1..MaxFreeIDs ids; the largest one goes through a
// SOCK_SEQPACKET socket whole. Requests are refused from the daemon.
func TestSendRequests(t *testing.T) {
	c, peer := socketPair(t)
	defer c.Close()
	for _, n := range []int{0, MaxFreeIDs + 1} {
		if err := c.Send(FreeReq{ReqID: 1, PageIDs: make([]uint64, n)}, nil, time.Time{}); err == nil {
			t.Errorf("FREE of %d ids accepted", n)
		}
		if err := c.Send(DroppedReq{ReqID: 1, PageIDs: make([]uint64, n)}, nil, time.Time{}); err == nil {
			t.Errorf("DROPPED of %d ids accepted", n)
		}
	}
	ids := make([]uint64, MaxFreeIDs)
	for i := range ids {
		ids[i] = uint64(i + 1)
	}
	if err := c.SendContext(context.Background(), FreeReq{ReqID: 9, PageIDs: ids}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, HeaderSize+freeFixed+8*MaxFreeIDs+1)
	n, _, _, _, err := unix.Recvmsg(peer, buf, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Decode(buf[:n], 0)
	if f, ok := r.(FreeReq); err != nil || !ok || f.ReqID != 9 || len(f.PageIDs) != MaxFreeIDs || f.PageIDs[MaxFreeIDs-1] != MaxFreeIDs {
		t.Fatalf("FREE of %d ids: %d bytes, %v", MaxFreeIDs, n, err)
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.SendContext(canceled, CloseReq{ReqID: 1}); !errors.Is(err, context.Canceled) {
		t.Fatalf("SendContext with a canceled context: %v", err)
	}
	// A REPLY with a long message fits the receive buffer.
	msg := strings.Repeat("x", 4000)
	if err := unix.Sendmsg(peer, Encode(Reply{ReqID: 4, Code: 5, Message: msg}), nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Recv(); err != nil || r.(Reply).Message != msg {
		t.Fatalf("long REPLY: %v", err)
	}
	// Request records only go from client to daemon.
	if err := unix.Sendmsg(peer, Encode(CloseReq{ReqID: 1}), nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Recv(); !errors.Is(err, ErrProtocol) {
		t.Fatalf("CLOSE from the daemon: %v", err)
	}
}

// A DROP carries 1..MaxDropIDs (the spec's max_drop_ids, 519) page ids, as
// the Python decoder reads it: 519 decode and go through the socket whole
// (the record is MaxRecord bytes); 520 are a protocol error with Python's
// message, and are cut on receipt.
func TestDropBound(t *testing.T) {
	if MaxDropIDs != 519 || HeaderSize+dropFixed+8*MaxDropIDs != MaxRecord {
		t.Fatalf("MaxDropIDs %d: a DROP of that many is not MaxRecord (%d) bytes", MaxDropIDs, MaxRecord)
	}
	drop := func(n int) []byte { // a DROP of ids 1..n, framed by hand
		p := make([]byte, dropFixed+8*n)
		binary.LittleEndian.PutUint32(p, uint32(n))
		for i := 0; i < n; i++ {
			binary.LittleEndian.PutUint64(p[dropFixed+8*i:], uint64(i+1))
		}
		return frame(TypeDrop, p)
	}
	r, err := Decode(drop(MaxDropIDs), 0)
	if d, ok := r.(Drop); err != nil || !ok || len(d.PageIDs) != MaxDropIDs || d.PageIDs[MaxDropIDs-1] != MaxDropIDs {
		t.Fatalf("DROP of %d ids: %#v, %v", MaxDropIDs, r, err)
	}
	_, err = Decode(drop(MaxDropIDs+1), 0)
	want := "DROP record says 520 page ids and has 4160 bytes of them" // fdchannel.py's message
	if !errors.Is(err, ErrProtocol) || !strings.HasSuffix(err.Error(), ": "+want) {
		t.Fatalf("DROP of %d ids: %v, want a protocol error %q", MaxDropIDs+1, err, want)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Errorf("Encode of a DROP of %d ids did not panic", MaxDropIDs+1)
			}
		}()
		Encode(Drop{PageIDs: make([]uint64, MaxDropIDs+1)})
	}()
	c, peer := socketPair(t)
	defer c.Close()
	for _, n := range []int{MaxDropIDs, MaxDropIDs + 1} {
		if err := unix.Sendmsg(peer, drop(n), nil, nil, 0); err != nil {
			t.Fatal(err)
		}
		r, err := c.Recv()
		if n == MaxDropIDs && (err != nil || len(r.(Drop).PageIDs) != n) {
			t.Fatalf("received DROP of %d ids: %v", n, err)
		}
		if n > MaxDropIDs && !errors.Is(err, ErrProtocol) {
			t.Fatalf("received DROP of %d ids: %v, want a protocol error", n, err)
		}
	}
}

// A send blocked on a full socket returns when its context is canceled
// (not only at a deadline), and a later send is not affected.
func TestSendContextCancelsBlockedSend(t *testing.T) {
	c, peer := socketPair(t)
	defer c.Close()
	ids := make([]uint64, MaxFreeIDs)
	for {
		err := c.Send(FreeReq{ReqID: 1, PageIDs: ids}, nil, time.Now().Add(50*time.Millisecond))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.SendContext(ctx, CloseReq{ReqID: 2}) }()
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled send: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a canceled send stayed blocked")
	}
	// Drain the peer: the next send goes through.
	buf := make([]byte, 1<<18)
	for {
		if _, _, _, _, err := unix.Recvmsg(peer, buf, nil, unix.MSG_DONTWAIT); err != nil {
			break
		}
	}
	if err := c.SendContext(context.Background(), CloseReq{ReqID: 3}); err != nil {
		t.Fatalf("send after a canceled one: %v", err)
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
