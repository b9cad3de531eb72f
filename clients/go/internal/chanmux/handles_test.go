package chanmux

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// fakeHandles is a cache of kept handles that keeps the pages it is told
// and records what the Mux asks of it, in order.
type fakeHandles struct {
	mu    sync.Mutex
	kept  map[uint64]bool
	calls []string
}

func (h *fakeHandles) Keeps(ids []uint64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, id := range ids {
		if h.kept[id] {
			return true
		}
	}
	return false
}

func (h *fakeHandles) Drop(ids []uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, id := range ids {
		delete(h.kept, id)
	}
	h.calls = append(h.calls, fmt.Sprintf("drop %v", ids))
}

func (h *fakeHandles) Reset(gen uint64, final bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.kept)
	h.calls = append(h.calls, fmt.Sprintf("reset %d %v", gen, final))
}

func (h *fakeHandles) log() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.calls)
}

// allocateFake runs an Allocate of ids against the fake daemon.
func allocateFake(t *testing.T, s *Mux, fc *fakeChannel, ids []uint64) *Allocation {
	t.Helper()
	got := make(chan *Allocation, 1)
	go func() {
		a, err := s.Allocate(testdaemon.Ctx(t), fdchan.AllocateReq{NumPages: uint32(len(ids))})
		if err != nil {
			t.Error(err)
		}
		got <- a
	}()
	req := fc.next().(fdchan.AllocateReq)
	fc.sendPages(req.ReqID, ids)
	fc.send(fdchan.Reply{ReqID: req.ReqID, Value: uint64(len(ids)) * 4096})
	a := <-got
	if a == nil {
		t.FailNow()
	}
	fdchan.CloseFDs(a.FDs)
	return a
}

// A FREE carries keep exactly when the cache keeps a handle of one of its
// pages; a DROP is answered at once by the reader, after the cache
// released the pages named, with DROPPED naming every page of the DROP,
// and nobody waits for its REPLY; GOODBYE releases every handle.
func TestKeptHandlesOnTheChannel(t *testing.T) {
	h := &fakeHandles{kept: map[uint64]bool{}}
	s, fc := newFakeChannelMuxConfig(t, Config{ID: 7, Log: slog.New(slog.DiscardHandler), Handles: h})
	ctx := testdaemon.Ctx(t)
	a := allocateFake(t, s, fc, []uint64{40, 41, 42})
	if a.Gen != 0 {
		t.Fatalf("allocation of generation %d, want 0", a.Gen)
	}
	h.mu.Lock()
	h.kept[41] = true
	h.mu.Unlock()

	for _, c := range []struct {
		ids  []uint64
		keep bool
	}{{[]uint64{40}, false}, {[]uint64{41, 42}, true}} {
		done := make(chan error, 1)
		go func() { _, err := s.Free(ctx, c.ids); done <- err }()
		f := fc.next().(fdchan.FreeReq)
		if !slices.Equal(f.PageIDs, c.ids) || f.Keep != c.keep {
			t.Fatalf("FREE %v keep %v; want %v keep %v", f.PageIDs, f.Keep, c.ids, c.keep)
		}
		fc.send(fdchan.Reply{ReqID: f.ReqID, Value: uint64(len(c.ids))})
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}

	// No call is in progress: the reader answers by itself.
	fc.send(fdchan.Drop{PageIDs: []uint64{41, 99}})
	d, ok := fc.next().(fdchan.DroppedReq)
	if !ok || !slices.Equal(d.PageIDs, []uint64{41, 99}) {
		t.Fatalf("answer to DROP: %#v", d)
	}
	if got := h.log(); !slices.Equal(got, []string{"drop [41 99]"}) {
		t.Fatalf("the cache was asked %v before DROPPED went out; want the drop of 41 and 99", got)
	}
	if h.Keeps([]uint64{41}) {
		t.Fatal("41 still kept after the DROP")
	}
	// Its REPLY answers no request: dropped, nothing waits.
	fc.send(fdchan.Reply{ReqID: d.ReqID, Value: 1})
	if _, w := s.Pending(); w != 0 {
		t.Fatalf("%d requests wait", w)
	}
	// The session goes on.
	allocateFake(t, s, fc, []uint64{43})

	fc.send(fdchan.Goodbye{})
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("GOODBYE did not end the session")
	}
	if got := h.log(); !slices.Equal(got, []string{"drop [41 99]", "reset 0 true"}) {
		t.Fatalf("after GOODBYE the cache was asked %v; want every handle released for good", got)
	}
}

// A malformed DROP is a protocol error: the session ends, every handle
// released.
func TestMalformedDropEndsTheSession(t *testing.T) {
	h := &fakeHandles{kept: map[uint64]bool{}}
	s, fc := newFakeChannelMuxConfig(t, Config{ID: 7, Log: slog.New(slog.DiscardHandler), Handles: h})
	bad := fdchan.Encode(fdchan.Drop{PageIDs: []uint64{7}})
	bad[16] = 2 // count 2, one id
	if err := unix.Sendmsg(fc.fd, bad, nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a malformed DROP did not end the session")
	}
	if err := s.Err(); err == nil || !strings.Contains(err.Error(), "protocol") || !strings.Contains(err.Error(), "DROP") {
		t.Fatalf("session ended with %v", err)
	}
	if got := h.log(); !slices.Equal(got, []string{"reset 0 true"}) {
		t.Fatalf("the cache was asked %v", got)
	}
}

// A resume releases every kept handle before it claims pages, and pages
// of the old channel are not kept after it (the cache's generation is the
// new channel's).
func TestResumeResetsKeptHandles(t *testing.T) {
	h := &fakeHandles{kept: map[uint64]bool{}}
	claimed := make(chan []string, 1)
	s, fc := newFakeChannelMuxConfig(t, Config{
		ID: 7, Log: slog.New(slog.DiscardHandler), FDSocket: fakeRestart(t), Handles: h,
		ResumeToken: []byte("token"), ResumeTimeout: 10 * time.Second,
		Resume: func(_ context.Context, _ []byte, ids []uint64) (*pb.ResumeSessionResponse, error) {
			claimed <- h.log() // what the cache was told before the claim
			return &pb.ResumeSessionResponse{Session: &pb.SessionRef{Id: 7}, PagesAdopted: uint64(len(ids))}, nil
		},
	})
	defer s.MarkClosed()
	allocateFake(t, s, fc, []uint64{40})
	h.mu.Lock()
	h.kept[40] = true
	h.mu.Unlock()
	unix.Shutdown(fc.fd, unix.SHUT_RDWR) // the daemon died
	select {
	case got := <-claimed:
		if !slices.Equal(got, []string{"reset 1 false"}) {
			t.Fatalf("before the resume claimed pages the cache was asked %v; want a reset to generation 1", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no resume within 10 s")
	}
	if err := s.WaitResumed(testdaemon.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	if h.Keeps([]uint64{40}) {
		t.Fatal("40 still kept after the resume")
	}
}
