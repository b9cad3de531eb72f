package chanmux

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// fakeChannel is the daemon's end of a session's fd channel, for tests of
// the request machinery without a daemon.
//
// Its reader goroutine owns fd: the descriptor is closed only after the
// reader has returned. (It used to be closed by the test's cleanup while the
// reader could still be between two recvmsg calls; the next test's socket
// pair then got the same descriptor number, and the stale reader took that
// test's requests off its socket: "fake daemon: no request within 5 s".)
type fakeChannel struct {
	t    *testing.T
	fd   int
	recs chan fdchan.Record
	stop chan struct{} // closed by the cleanup: the reader returns
	done chan struct{} // closed by the reader when it has returned
}

// newFakeChannelMux returns a session's multiplexer whose fd channel is a
// socket pair with the fake at the other end.
func newFakeChannelMux(t *testing.T) (*Mux, *fakeChannel) {
	t.Helper()
	return newFakeChannelMuxConfig(t, Config{ID: 7, Log: slog.New(slog.DiscardHandler)})
}

// newFakeChannelMuxConfig is newFakeChannelMux for a session of cfg.
func newFakeChannelMuxConfig(t *testing.T, cfg Config) (*Mux, *fakeChannel) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "client")
	nc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		unix.Close(fds[1])
		t.Fatal(err)
	}
	ch := fdchan.NewConn(nc.(*net.UnixConn))
	s := New(ch, nil, cfg)
	fc := &fakeChannel{t: t, fd: fds[1], recs: make(chan fdchan.Record, 64),
		stop: make(chan struct{}), done: make(chan struct{})}
	go fc.read()
	t.Cleanup(func() {
		s.Shutdown()
		// Wake the reader (a recvmsg on a shut-down socket returns 0 at
		// once), wait until it has returned, and only then give the
		// descriptor number back to the process.
		close(fc.stop)
		unix.Shutdown(fc.fd, unix.SHUT_RDWR)
		select {
		case <-fc.done:
		case <-time.After(10 * time.Second):
			t.Error("fake daemon: reader still running 10 s after the test; its fd is left open")
			return
		}
		unix.Close(fc.fd)
	})
	return s, fc
}

// read passes the records the client sends to recs until the socket ends or
// the test is over.
func (fc *fakeChannel) read() {
	defer close(fc.done)
	defer close(fc.recs)
	buf := make([]byte, fdchan.HeaderSize+16+8*fdchan.MaxFreeIDs)
	for {
		n, _, _, _, err := unix.Recvmsg(fc.fd, buf, nil, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			return
		}
		r, err := fdchan.Decode(buf[:n], 0)
		if err != nil {
			select {
			case <-fc.stop:
			default:
				fc.t.Errorf("fake daemon: %v", err)
			}
			continue
		}
		select {
		case fc.recs <- r:
		case <-fc.stop:
			return
		}
	}
}

func (fc *fakeChannel) next() fdchan.Record {
	fc.t.Helper()
	select {
	case r := <-fc.recs:
		return r
	case <-time.After(5 * time.Second):
		fc.t.Fatal("fake daemon: no request within 5 s")
		return nil
	}
}

func (fc *fakeChannel) send(r fdchan.Record, fds ...int) {
	fc.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(fc.fd, fdchan.Encode(r), oob, nil, 0); err != nil {
		fc.t.Fatal(err)
	}
}

// sendPages sends one PAGES record per page (memfds), as the answer to
// ALLOCATE req.
func (fc *fakeChannel) sendPages(req uint64, ids []uint64) {
	fc.t.Helper()
	for i, id := range ids {
		fd, err := unix.MemfdCreate("page", unix.MFD_CLOEXEC)
		if err != nil {
			fc.t.Fatal(err)
		}
		fc.send(fdchan.Pages{AllocationID: req | fdchan.AllocBit, FirstIndex: uint32(i), Total: uint32(len(ids)), PageIDs: []uint64{id}}, fd)
		unix.Close(fd)
	}
}

func TestChannelAllocateFreeClose(t *testing.T) {
	testdaemon.CheckGoroutines(t)
	s, fc := newFakeChannelMux(t)
	ctx := testdaemon.Ctx(t)

	got := make(chan *Allocation, 1)
	go func() {
		a, err := s.Allocate(ctx, fdchan.AllocateReq{NumPages: 2, Wait: true, WaitTimeoutMs: 1500})
		if err != nil {
			t.Error(err)
		}
		got <- a
	}()
	req, ok := fc.next().(fdchan.AllocateReq)
	if !ok || req.NumPages != 2 || !req.Wait || req.WaitTimeoutMs != 1500 || req.Device != "" {
		t.Fatalf("ALLOCATE: %+v", req)
	}
	fc.sendPages(req.ReqID, []uint64{40, 41})
	fc.send(fdchan.Reply{ReqID: req.ReqID, Value: 8192})
	a := <-got
	if a == nil || a.ID != req.ReqID|fdchan.AllocBit || a.HeldBytes != 8192 ||
		len(a.IDs) != 2 || a.IDs[0] != 40 || a.IDs[1] != 41 || len(a.FDs) != 2 || a.FDs[0] < 0 || a.FDs[1] < 0 {
		t.Fatalf("allocation %+v", a)
	}
	fdchan.CloseFDs(a.FDs)

	// A Free of more than MaxFreeIDs pages goes as several FREE records.
	ids := make([]uint64, 2*fdchan.MaxFreeIDs+5)
	for i := range ids {
		ids[i] = uint64(i + 1)
	}
	freed := make(chan uint64, 1)
	go func() {
		r, err := s.Free(ctx, ids)
		if err != nil {
			t.Error(err)
		}
		freed <- r
	}()
	next := uint64(1)
	for _, want := range []int{fdchan.MaxFreeIDs, fdchan.MaxFreeIDs, 5} {
		f, ok := fc.next().(fdchan.FreeReq)
		if !ok || len(f.PageIDs) != want || f.PageIDs[0] != next {
			t.Fatalf("FREE record: %d ids from %d, want %d from %d", len(f.PageIDs), f.PageIDs[0], want, next)
		}
		next += uint64(want)
		fc.send(fdchan.Reply{ReqID: f.ReqID, Value: uint64(len(f.PageIDs))})
	}
	if n := <-freed; n != uint64(len(ids)) {
		t.Fatalf("freed %d", n)
	}
	if _, err := s.Free(ctx, nil); !errors.Is(err, errs.ErrInvalidArgument) {
		t.Fatalf("Free(nil): %v", err)
	}

	// CLOSE: the REPLY, then the daemon says GOODBYE and closes.
	closed := make(chan error, 1)
	s.MarkClosed()
	go func() { closed <- s.CloseRequest(ctx) }()
	c, ok := fc.next().(fdchan.CloseReq)
	if !ok {
		t.Fatalf("CLOSE: %#v", c)
	}
	fc.send(fdchan.Reply{ReqID: c.ReqID, Value: 0})
	fc.send(fdchan.Goodbye{})
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if _, err := s.Allocate(ctx, fdchan.AllocateReq{NumPages: 1}); !errors.Is(err, errs.ErrClosed) {
		t.Fatalf("Allocate after Close: %v", err)
	}
}

// A REPLY's code becomes the same error as that gRPC status (one mapping).
func TestChannelReplyCodes(t *testing.T) {
	s, fc := newFakeChannelMux(t)
	ctx := testdaemon.Ctx(t)
	for _, row := range errs.Table() {
		done := make(chan error, 1)
		go func() {
			_, err := s.Free(ctx, []uint64{1})
			done <- err
		}()
		f := fc.next().(fdchan.FreeReq)
		fc.send(fdchan.Reply{ReqID: f.ReqID, Code: uint32(row.Code), Message: "because " + row.Code.String()})
		err := <-done
		var e *errs.Error
		if !errors.Is(err, row.Err) || !errors.As(err, &e) || e.Code != row.Code || e.Message != "because "+row.Code.String() || e.Op != "Free" {
			t.Errorf("REPLY code %v: %v", row.Code, err)
		}
	}
	// An ALLOCATE answered with an error carries no pages.
	done := make(chan error, 1)
	go func() {
		_, err := s.Allocate(ctx, fdchan.AllocateReq{NumPages: 3})
		done <- err
	}()
	req := fc.next().(fdchan.AllocateReq)
	fc.send(fdchan.Reply{ReqID: req.ReqID, Code: 8, Message: "budget exhausted"})
	if err := <-done; !errors.Is(err, errs.ErrResourceExhausted) {
		t.Fatalf("ALLOCATE refused: %v", err)
	}
	// An answer without its pages breaks the protocol.
	go func() {
		_, err := s.Allocate(ctx, fdchan.AllocateReq{NumPages: 2})
		done <- err
	}()
	req = fc.next().(fdchan.AllocateReq)
	fc.sendPages(req.ReqID, []uint64{9})
	fc.send(fdchan.Reply{ReqID: req.ReqID})
	if err := <-done; !errors.Is(err, errs.ErrProtocol) {
		t.Fatalf("ALLOCATE answered with 1 of 2 pages: %v", err)
	}
	if allocs, waiters := s.Pending(); allocs != 0 || waiters != 0 {
		t.Fatalf("left behind: %d allocations, %d waiters", allocs, waiters)
	}
}

// A caller whose context ends gets its error at once; the pages that the
// daemon sends later are given back with a FREE, and nothing is left
// behind. A Free abandoned the same way is answered quietly.
func TestChannelAbandonedRequests(t *testing.T) {
	s, fc := newFakeChannelMux(t)
	ctx := testdaemon.Ctx(t)
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := s.Allocate(short, fdchan.AllocateReq{NumPages: 2, Wait: true, WaitTimeoutMs: 60000})
		done <- err
	}()
	req := fc.next().(fdchan.AllocateReq)
	err := <-done
	if !errors.Is(err, errs.ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Fatalf("abandoned Allocate: %v after %v", err, time.Since(start))
	}
	fc.sendPages(req.ReqID, []uint64{70, 71})
	fc.send(fdchan.Reply{ReqID: req.ReqID, Value: 8192})
	f, ok := fc.next().(fdchan.FreeReq)
	if !ok || len(f.PageIDs) != 2 || f.PageIDs[0] != 70 || f.PageIDs[1] != 71 {
		t.Fatalf("the abandoned pages were not given back: %#v", f)
	}
	fc.send(fdchan.Reply{ReqID: f.ReqID, Value: 2})

	canceled, cancel2 := context.WithCancel(ctx)
	go func() {
		_, err := s.Free(canceled, []uint64{5})
		done <- err
	}()
	f = fc.next().(fdchan.FreeReq)
	cancel2()
	if err := <-done; !errors.Is(err, errs.ErrCanceled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Free: %v", err)
	}
	fc.send(fdchan.Reply{ReqID: f.ReqID, Value: 1})
	testdaemon.WaitFor(t, 2*time.Second, "nothing left behind", func() (bool, string) {
		allocs, waiters := s.Pending()
		return allocs == 0 && waiters == 0, ""
	})
	// The channel ends: a waiting request fails at once.
	go func() {
		_, err := s.Free(ctx, []uint64{6})
		done <- err
	}()
	fc.next()
	unix.Shutdown(fc.fd, unix.SHUT_RDWR)
	if err := <-done; !errors.Is(err, errs.ErrClosed) {
		t.Fatalf("Free when the channel ended: %v", err)
	}
}
