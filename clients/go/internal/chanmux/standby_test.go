package chanmux

import (
	"errors"
	"log/slog"
	"slices"
	"testing"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// Standby pages on the channel (docs/protocol.md, "Standby pages"): Standby
// is a FREE with the standby flag (never keep, even where a handle is
// kept), waited for and checked as a Free, in records of at most
// MaxFreeIDs ids; Use sends USE records with request ids of their own that
// nobody waits for, so their REPLY is dropped.
func TestStandbyAndUseOnTheChannel(t *testing.T) {
	testdaemon.CheckGoroutines(t)
	h := &fakeHandles{kept: map[uint64]bool{41: true}}
	s, fc := newFakeChannelMuxConfig(t, Config{ID: 7, Log: slog.New(slog.DiscardHandler), Handles: h})
	ctx := testdaemon.Ctx(t)
	allocateFake(t, s, fc, []uint64{40, 41, 42})

	done := make(chan error, 1)
	var named uint64
	go func() {
		var err error
		named, err = s.Standby(ctx, []uint64{40, 41})
		done <- err
	}()
	f, ok := fc.next().(fdchan.FreeReq)
	if !ok || !slices.Equal(f.PageIDs, []uint64{40, 41}) || !f.Standby || f.Keep || f.Flags != fdchan.FreeStandby {
		t.Fatalf("standby FREE: %#v; want 40 and 41 with the standby flag only", f)
	}
	fc.send(fdchan.Reply{ReqID: f.ReqID, Value: 2})
	if err := <-done; err != nil || named != 2 {
		t.Fatalf("Standby: %d, %v", named, err)
	}

	// All or nothing, errors as for a Free.
	go func() { _, err := s.Standby(ctx, []uint64{42, 999}); done <- err }()
	f = fc.next().(fdchan.FreeReq)
	fc.send(fdchan.Reply{ReqID: f.ReqID, Code: 5, Message: "page 999 is not held"})
	if err := <-done; !errors.Is(err, errs.ErrNotFound) {
		t.Fatalf("Standby of a page not held: %v", err)
	}
	if _, err := s.Standby(ctx, nil); !errors.Is(err, errs.ErrInvalidArgument) {
		t.Fatalf("Standby(nil): %v", err)
	}

	// More than MaxFreeIDs: several records.
	ids := make([]uint64, fdchan.MaxFreeIDs+3)
	for i := range ids {
		ids[i] = uint64(1000 + i)
	}
	go func() { _, err := s.Standby(ctx, ids); done <- err }()
	for _, want := range []int{fdchan.MaxFreeIDs, 3} {
		f := fc.next().(fdchan.FreeReq)
		if len(f.PageIDs) != want || !f.Standby {
			t.Fatalf("standby FREE of %d ids (standby %v), want %d", len(f.PageIDs), f.Standby, want)
		}
		fc.send(fdchan.Reply{ReqID: f.ReqID, Value: uint64(want)})
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// USE: sent at once, nothing waits; each record has an id of its own.
	if n := s.Use([]uint64{40, 41}); n != 1 {
		t.Fatalf("Use sent %d records", n)
	}
	u, ok := fc.next().(fdchan.UseReq)
	if !ok || !slices.Equal(u.PageIDs, []uint64{40, 41}) {
		t.Fatalf("USE: %#v", u)
	}
	if n := s.Use(ids); n != 2 {
		t.Fatalf("Use of %d ids sent %d records, want 2", len(ids), n)
	}
	u2, u3 := fc.next().(fdchan.UseReq), fc.next().(fdchan.UseReq)
	if len(u2.PageIDs) != fdchan.MaxFreeIDs || len(u3.PageIDs) != 3 || u2.ReqID == u.ReqID || u3.ReqID == u2.ReqID {
		t.Fatalf("USE records: %d ids (req %d), %d ids (req %d) after req %d", len(u2.PageIDs), u2.ReqID, len(u3.PageIDs), u3.ReqID, u.ReqID)
	}
	if _, w := s.Pending(); w != 0 {
		t.Fatalf("%d requests wait after USE", w)
	}
	// Their REPLYs answer no request: dropped; the session goes on.
	for _, r := range []uint64{u.ReqID, u2.ReqID, u3.ReqID} {
		fc.send(fdchan.Reply{ReqID: r, Value: 2})
	}
	allocateFake(t, s, fc, []uint64{43})

	// Closed: Standby refuses as Free does, Use sends nothing.
	s.MarkClosed()
	if _, err := s.Standby(ctx, []uint64{43}); !errors.Is(err, errs.ErrFailedPrecondition) {
		t.Fatalf("Standby after close: %v", err)
	}
	if n := s.Use([]uint64{43}); n != 0 {
		t.Fatalf("Use after close sent %d records", n)
	}
}
