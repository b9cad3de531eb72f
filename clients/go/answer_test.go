package kvcached

import (
	"context"
	"errors"
	"testing"
	"time"
)

// The reclaim answer (docs/protocol.md, "The reclaim answer") against a
// real daemon: an idle session gives back part of what it is asked for and
// answers with what it gave and kept (an ANSWER record on its fd channel);
// the shrinking session's Shrink(ShrinkWait) returns as soon as the request
// is settled, with the answer and the daemon's own books.
func TestReclaimAnswer(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		checkGoroutines(t)
		_, c := connect(t, backend)
		ctx := testCtx(t)
		type answered struct {
			r          Reclaim
			held       uint64
			given, kpt uint64
			err        error
		}
		answers := make(chan answered, 4)
		var region *Region
		var idle *Session
		ready := make(chan struct{}) // closed once idle and region are set
		var err error
		idle, err = c.OpenSession(ctx, "sha256:answering-runner", WithReclaimHandler(func(hctx context.Context, r Reclaim) {
			<-ready
			// Give back 4 pages of the pages asked for, keep the rest: the
			// rest is "in use by busy slots".
			ps := region.PageSize()
			keep := region.MappedBytes() - 4*ps
			if err := region.Trim(hctx, keep); err != nil {
				answers <- answered{r: r, err: err}
				return
			}
			held, err := idle.AnswerReclaim(hctx, r.ID, 4*ps, keep, "the rest is in use by busy slots")
			answers <- answered{r: r, held: held, given: 4 * ps, kpt: keep, err: err}
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer idle.Close(ctx)
		if !idle.ChannelRequests() {
			t.Fatal("the daemon does not take requests on the fd channel")
		}
		ps := idle.Info().Devices[0].PageSize
		region, err = idle.NewRegion(ctx, 64*ps)
		if err != nil {
			t.Fatal(err)
		}
		if err := region.Grow(ctx, 32*ps); err != nil {
			t.Fatal(err)
		}
		close(ready)

		// An id this session was never sent: NOT_FOUND, the session goes on.
		if _, err := idle.AnswerReclaim(ctx, 1<<62, 0, 0, "never asked"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("AnswerReclaim of an unknown id: %v", err)
		}
		if _, err := idle.AnswerReclaim(ctx, 1, 0, 0, string(make([]byte, 1025))); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("AnswerReclaim with a 1025-byte reason: %v", err)
		}

		admin, err := c.OpenSession(ctx, "ollama-scheduler")
		if err != nil {
			t.Fatal(err)
		}
		defer admin.Close(ctx)
		// Ask for everything above 8 pages, and wait: the answer settles the
		// request long before the 20 s the request has.
		start := time.Now()
		out, err := admin.Shrink(ctx, idle.ID(), 8*ps, 20*time.Second, ShrinkWait())
		took := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		if out.PagesRequested != 24 || len(out.Reclaims) != 1 {
			t.Fatalf("shrink: %+v", out)
		}
		var a answered
		select {
		case a = <-answers:
		case <-time.After(10 * time.Second):
			t.Fatal("the reclaim handler did not run")
		}
		if a.err != nil {
			t.Fatalf("the handler: %v", a.err)
		}
		o := out.Reclaims[0]
		if a.r.ID == 0 || o.ReclaimID != a.r.ID || a.r.Pages != 24 {
			t.Fatalf("the event %+v, the outcome %+v", a.r, o)
		}
		if o.State != ReclaimAnswered || !o.Answered || o.BytesGiven != 4*ps || o.BytesKept != 28*ps ||
			o.Reason != "the rest is in use by busy slots" || o.HeldBytes != 28*ps || o.Device != idle.Info().Devices[0].UUID {
			t.Fatalf("outcome %+v (state %v)", o, o.State)
		}
		if a.held != 28*ps {
			t.Fatalf("AnswerReclaim's REPLY says the session holds %d bytes, want %d", a.held, 28*ps)
		}
		// Settled by the answer: well before the request's 20 s (a generous
		// bound for a loaded 2-core machine).
		if took > 15*time.Second {
			t.Fatalf("Shrink(ShrinkWait) took %v: the answer did not settle the request", took)
		}
		t.Logf("%s: shrink answered in %v", backend, took)

		// Without an answer, Frees that meet the request settle it too: MET.
		meet := make(chan error, 1)
		var region2 *Region
		ready2 := make(chan struct{})
		idle2, err := c.OpenSession(ctx, "sha256:meeting-runner", WithReclaimHandler(func(hctx context.Context, r Reclaim) {
			<-ready2
			meet <- region2.Trim(hctx, 2*ps)
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer idle2.Close(ctx)
		region2, err = idle2.NewRegion(ctx, 16*ps)
		if err != nil {
			t.Fatal(err)
		}
		if err := region2.Grow(ctx, 10*ps); err != nil {
			t.Fatal(err)
		}
		close(ready2)
		out, err = admin.Shrink(ctx, idle2.ID(), 2*ps, 20*time.Second, ShrinkWait())
		if err != nil {
			t.Fatal(err)
		}
		if err := <-meet; err != nil {
			t.Fatalf("trim in the handler: %v", err)
		}
		if len(out.Reclaims) != 1 || out.Reclaims[0].State != ReclaimMet || out.Reclaims[0].Answered || out.Reclaims[0].HeldBytes != 2*ps {
			t.Fatalf("outcome without an answer: %+v", out)
		}
	})
}
