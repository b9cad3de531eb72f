package kvcached

import (
	"errors"
	"testing"
)

// The admin rpcs (admin.go) against a real daemon: this process runs as the
// daemon's uid, so its sessions are admin sessions. SetLimits changes only
// the fields it is given; an unknown session is NOT_FOUND. (A non-admin
// refused: ollama/ollama_test.go, TestOllamaHandleWithoutAdmin, as uid
// nobody. Shrink with ShrinkWait: answer_test.go.)
func TestSetLimits(t *testing.T) {
	_, c := connect(t, "host")
	ctx := testCtx(t)
	admin, err := c.OpenSession(ctx, "admin-setlimits")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if !admin.Admin() {
		t.Fatal("the test runs as the daemon's uid, which is always admin")
	}
	target, err := c.OpenSession(ctx, "target-setlimits", WithGuaranteedBytes(4<<20), WithMaxBytes(64<<20), WithPriority(3))
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close(ctx)
	g := uint64(8 << 20)
	ss, err := admin.SetLimits(ctx, target.ID(), Limits{GuaranteedBytes: &g})
	if err != nil {
		t.Fatal(err)
	}
	if ss.ID != target.ID() || ss.GuaranteedBytes != g || ss.MaxBytes != 64<<20 || ss.Priority != 3 {
		t.Fatalf("after setting the guarantee only: %+v", ss)
	}
	m, p := uint64(32<<20), int32(-1)
	if ss, err = admin.SetLimits(ctx, target.ID(), Limits{MaxBytes: &m, Priority: &p}); err != nil {
		t.Fatal(err)
	}
	if ss.GuaranteedBytes != g || ss.MaxBytes != m || ss.Priority != p {
		t.Fatalf("after setting max and priority: %+v", ss)
	}
	own, err := target.Own(ctx)
	if err != nil || own.GuaranteedBytes != g || own.MaxBytes != m || own.Priority != p {
		t.Fatalf("the target's own books: %+v %v", own, err)
	}
	if _, err := admin.SetLimits(ctx, 1<<40, Limits{GuaranteedBytes: &g}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("SetLimits(unknown session): %v", err)
	}
}
