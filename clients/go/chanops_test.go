package kvcached

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
)

// fakeChannel is the daemon's end of a session's fd channel, for tests of
// the request machinery without a daemon.
type fakeChannel struct {
	t    *testing.T
	fd   int
	recs chan fdchan.Record
}

// newFakeChannelSession returns a session (requests on the channel) whose
// fd channel is a socket pair with the fake at the other end.
func newFakeChannelSession(t *testing.T) (*Session, *fakeChannel) {
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
	ch := fdchan.NewConn(nc.(*net.UnixConn))
	s := &Session{
		id: 7, info: &Info{Devices: []Device{{UUID: "HOST-0", Kind: "host", PageSize: 4096}}, FDChannelRequests: true},
		ch: ch, log: slog.New(slog.DiscardHandler), readerDone: make(chan struct{}),
		allocs: map[allocKey]*pendingAlloc{}, waiters: map[uint64]*waiter{}, regions: map[*Region]struct{}{},
		mappers: map[string]mapper{}, keep: map[uint64]kept{}, deferred: map[uint64]uint64{},
		lost: make(chan struct{}), resumed: make(chan struct{}),
	}
	close(s.resumed)
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.readLoop(ch)
	fc := &fakeChannel{t: t, fd: fds[1], recs: make(chan fdchan.Record, 64)}
	go func() {
		buf := make([]byte, fdchan.HeaderSize+16+8*fdchan.MaxFreeIDs)
		for {
			n, _, _, _, err := unix.Recvmsg(fc.fd, buf, nil, 0)
			if err != nil || n == 0 {
				close(fc.recs)
				return
			}
			r, err := fdchan.Decode(buf[:n], 0)
			if err != nil {
				t.Errorf("fake daemon: %v", err)
				continue
			}
			fc.recs <- r
		}
	}()
	t.Cleanup(func() {
		s.stop()
		ch.Close()
		s.wg.Wait()
		unix.Close(fc.fd)
	})
	return s, fc
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
	checkGoroutines(t)
	s, fc := newFakeChannelSession(t)
	ctx := testCtx(t)

	got := make(chan *Allocation, 1)
	go func() {
		a, err := s.Allocate(ctx, 2, WaitUpTo(1500*time.Millisecond))
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
	if a == nil || a.ID != req.ReqID|fdchan.AllocBit || a.Device != "HOST-0" || a.PageSize != 4096 || a.HeldBytes != 8192 ||
		len(a.Pages) != 2 || a.Pages[0].ID != 40 || a.Pages[1].ID != 41 || a.Pages[0].File == nil {
		t.Fatalf("allocation %+v", a)
	}
	a.Close()

	// A Free of more than MaxFreeIDs pages goes as several FREE records.
	ids := make([]uint64, 2*fdchan.MaxFreeIDs+5)
	for i := range ids {
		ids[i] = uint64(i + 1)
	}
	freed := make(chan FreeResult, 1)
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
	if r := <-freed; r.PagesFreed != uint64(len(ids)) {
		t.Fatalf("freed %d", r.PagesFreed)
	}
	if _, err := s.Free(ctx, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Free(nil): %v", err)
	}

	// CLOSE: the REPLY, then the daemon says GOODBYE and closes.
	closed := make(chan error, 1)
	go func() { closed <- s.Close(ctx) }()
	c, ok := fc.next().(fdchan.CloseReq)
	if !ok {
		t.Fatalf("CLOSE: %#v", c)
	}
	fc.send(fdchan.Reply{ReqID: c.ReqID, Value: 0})
	fc.send(fdchan.Goodbye{})
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if _, err := s.Allocate(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Allocate after Close: %v", err)
	}
}

// A REPLY's code becomes the same error as that gRPC status (one mapping).
func TestChannelReplyCodes(t *testing.T) {
	s, fc := newFakeChannelSession(t)
	ctx := testCtx(t)
	for _, row := range errs.Table() {
		done := make(chan error, 1)
		go func() {
			_, err := s.Free(ctx, []uint64{1})
			done <- err
		}()
		f := fc.next().(fdchan.FreeReq)
		fc.send(fdchan.Reply{ReqID: f.ReqID, Code: uint32(row.Code), Message: "because " + row.Code.String()})
		err := <-done
		var e *Error
		if !errors.Is(err, row.Err) || !errors.As(err, &e) || e.Code != row.Code || e.Message != "because "+row.Code.String() || e.Op != "Free" {
			t.Errorf("REPLY code %v: %v", row.Code, err)
		}
	}
	// An ALLOCATE answered with an error carries no pages.
	done := make(chan error, 1)
	go func() {
		_, err := s.Allocate(ctx, 3)
		done <- err
	}()
	req := fc.next().(fdchan.AllocateReq)
	fc.send(fdchan.Reply{ReqID: req.ReqID, Code: 8, Message: "budget exhausted"})
	if err := <-done; !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("ALLOCATE refused: %v", err)
	}
	// An answer without its pages breaks the protocol.
	go func() {
		_, err := s.Allocate(ctx, 2)
		done <- err
	}()
	req = fc.next().(fdchan.AllocateReq)
	fc.sendPages(req.ReqID, []uint64{9})
	fc.send(fdchan.Reply{ReqID: req.ReqID})
	if err := <-done; !errors.Is(err, ErrProtocol) {
		t.Fatalf("ALLOCATE answered with 1 of 2 pages: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.allocs) != 0 || len(s.waiters) != 0 {
		t.Fatalf("left behind: %d allocations, %d waiters", len(s.allocs), len(s.waiters))
	}
}

// A caller whose context ends gets its error at once; the pages that the
// daemon sends later are given back with a FREE, and nothing is left
// behind. A Free abandoned the same way is answered quietly.
func TestChannelAbandonedRequests(t *testing.T) {
	s, fc := newFakeChannelSession(t)
	ctx := testCtx(t)
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := s.Allocate(short, 2, WaitUpTo(time.Minute))
		done <- err
	}()
	req := fc.next().(fdchan.AllocateReq)
	err := <-done
	if !errors.Is(err, ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
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
	if err := <-done; !errors.Is(err, ErrCanceled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Free: %v", err)
	}
	fc.send(fdchan.Reply{ReqID: f.ReqID, Value: 1})
	waitFor(t, 2*time.Second, "nothing left behind", func() (bool, string) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.allocs) == 0 && len(s.waiters) == 0, ""
	})
	// The channel ends: a waiting request fails at once.
	go func() {
		_, err := s.Free(ctx, []uint64{6})
		done <- err
	}()
	fc.next()
	unix.Shutdown(fc.fd, unix.SHUT_RDWR)
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Free when the channel ended: %v", err)
	}
}
