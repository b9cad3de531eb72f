package chanmux

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
)

// Requests on the fd channel (docs/protocol.md, "Requests on the channel"):
// ALLOCATE, FREE, CLOSE, ANSWER and USE records on the session's own fd
// channel; no token travels, the kernel names the sender. Every request
// has an id of its own (the table, table.go); the reader goroutine hands
// each REPLY to the goroutine waiting for it. An ALLOCATE's pages arrive
// as PAGES records with allocation id req_id|AllocBit, all before its
// REPLY, so they are complete when the REPLY is read. After a resume the
// requests go on the new channel.

// chanCall is one request in flight on a channel.
type chanCall struct {
	m    *Mux
	ch   *fdchan.Conn
	gen  uint64
	lost chan struct{}
	req  uint64
	w    *waiter
	pa   *pendingAlloc // an ALLOCATE's allocation
}

// startRequest registers a request on the current fd channel; with alloc
// its allocation is stashed too. closing allows the CLOSE of Close. On
// error it returns the channel generation the call would have used.
func (m *Mux) startRequest(op string, closing, alloc bool) (*chanCall, uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.resumeErr != nil {
		return nil, m.gen, m.resumeErr
	}
	if (m.closed && !closing) || m.endErr != nil {
		return nil, m.gen, m.closedErrLocked(op)
	}
	select {
	case <-m.rd.done:
		return nil, m.gen, m.closedErrLocked(op)
	default:
	}
	if m.resuming {
		return nil, m.gen, awayErr(m.id, op, "")
	}
	c := &chanCall{m: m, ch: m.ch, gen: m.gen, lost: m.lost}
	c.req, c.w = m.reqs.add(m.gen, nil)
	if alloc {
		_, c.pa = m.reqs.addAlloc(m.gen, c.req)
	}
	return c, c.gen, nil
}

// alloc names the call's allocation in the table.
func (c *chanCall) alloc() orphan { return orphan{allocKey{c.gen, c.req | fdchan.AllocBit}, c.pa} }

// send sends the request's record; on failure the waiter is removed and
// an allocation discarded. Nothing was sent then.
func (c *chanCall) send(ctx context.Context, op string, r fdchan.Record) error {
	err := c.ch.SendContext(ctx, r)
	if err == nil {
		return nil
	}
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reqs.remove(c.req)
	if c.pa != nil {
		m.reqs.discard(c.alloc(), false, m.keep)
	}
	switch {
	case ctx.Err() != nil:
		return errs.FromStatus(op, ctx.Err())
	case m.endErr != nil || (m.closed && op != "CloseSession"):
		return m.closedErrLocked(op)
	case m.resumable:
		return awayErr(m.id, op, "sending on the fd channel: %v", err)
	}
	return errs.New(errs.ErrUnavailable, op, "sending on the fd channel: %v", err)
}

// await waits for the request's REPLY. A REPLY with a non-zero code is
// mapped like a gRPC status (RPCErr, errs.FromStatus). When ctx ends first
// the request is abandoned: its allocation is no longer claimed, and late
// (if not nil) runs under the Mux's lock when the REPLY comes.
func (c *chanCall) await(ctx context.Context, op string, late func(fdchan.Reply)) (fdchan.Reply, error) {
	m := c.m
	select {
	case <-c.w.done:
	case <-ctx.Done():
	case <-c.lost:
	case <-m.rd.done:
	}
	m.mu.Lock()
	select {
	case <-c.w.done:
		m.mu.Unlock()
		r := c.w.reply
		if r.Code != 0 {
			return r, m.RPCErr(op, c.gen, status.Error(codes.Code(r.Code), r.Message))
		}
		return r, nil
	default:
	}
	defer m.mu.Unlock()
	select {
	case <-m.rd.done:
		m.reqs.remove(c.req)
		return fdchan.Reply{}, m.closedErrLocked(op)
	case <-c.lost:
		m.reqs.remove(c.req)
		return fdchan.Reply{}, awayErr(m.id, op, "the fd channel hung up before the answer")
	default:
	}
	// The caller's context ended: the REPLY still comes, later.
	m.reqs.abandon(c.w, c.pa, late)
	return fdchan.Reply{}, errs.FromStatus(op, ctx.Err())
}

// Allocation is what an ALLOCATE request brought: the pages' ids and
// descriptors, in order (the caller owns the descriptors).
type Allocation struct {
	ID        uint64 // allocation id: the request id | fdchan.AllocBit
	Gen       uint64 // the fd channel generation the pages came on (Handles.Reset)
	IDs       []uint64
	FDs       []int
	HeldBytes uint64 // the REPLY's value: bytes held on the device afterwards
}

// Allocate sends ALLOCATE (its ReqID is set here) and waits for its pages
// and REPLY. A caller whose ctx ends gets its error at once; the pages,
// when they come, are given back with FREE.
func (m *Mux) Allocate(ctx context.Context, rec fdchan.AllocateReq) (*Allocation, error) {
	const op = "Allocate"
	m.ops.begin()
	defer m.ops.end()
	c, _, err := m.startRequest(op, false, true)
	if err != nil {
		return nil, err
	}
	o := c.alloc()
	defer func() {
		// When no Allocate is left in flight, complete allocations nobody
		// claimed are given back.
		m.mu.Lock()
		defer m.mu.Unlock()
		for _, o := range m.reqs.allocateDone() {
			m.dropOrphanLocked(o)
		}
	}()
	rec.ReqID = c.req
	if err := c.send(ctx, op, rec); err != nil {
		return nil, err
	}
	// An abandoned call's pages are given back once complete (by the
	// deferred drop above, by the reader, or at the late REPLY).
	rep, err := c.await(ctx, op, func(r fdchan.Reply) {
		if o := m.reqs.lateReply(o, r.Code == 0, m.keep); o != nil {
			m.dropOrphanLocked(*o)
		}
	})
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		// A refusal (or the channel ended): nothing to give back.
		m.reqs.discard(o, true, m.keep)
		return nil, err
	}
	ids, fds, received, ok := m.reqs.take(o, int(rec.NumPages), m.keep)
	if !ok {
		// A REPLY OK before all the pages: the daemon broke the protocol.
		err := errs.New(errs.ErrProtocol, op, "request %d: %d of %d pages arrived before the answer", c.req, received, rec.NumPages)
		if c.gen == m.gen { // (a REPLY of a channel since replaced ends nothing now)
			// Calls fail with err from now on, and the channel is closed
			// (the daemon ends the session; the reader sees the close and
			// does not resume).
			if m.endErr == nil {
				m.endErr = err
			}
			c.ch.Close()
		}
		return nil, err
	}
	return &Allocation{ID: o.key.id, Gen: c.gen, IDs: ids, FDs: fds, HeldBytes: rep.Value}, nil
}

// Free sends FREE records of at most fdchan.MaxFreeIDs ids. All
// or nothing holds for each record; the pages of records answered before
// a failure are freed (PagesFreed counts them).
func (m *Mux) Free(ctx context.Context, ids []uint64) (uint64, error) {
	if len(ids) == 0 {
		return 0, errs.New(errs.ErrInvalidArgument, "Free", "page_ids is empty: name the pages to free")
	}
	m.mu.Lock()
	if m.closed {
		// As the daemon answers a gRPC Free of a closed session.
		m.mu.Unlock()
		return 0, errs.New(errs.ErrFailedPrecondition, "Free", "session %d is closed", m.id)
	}
	m.mu.Unlock()
	var freed uint64
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		n, err := m.freeChunk(ctx, ids[i:min(i+fdchan.MaxFreeIDs, len(ids))])
		freed += n
		if err != nil {
			return freed, err
		}
	}
	return freed, nil
}

// freeChunk is Free's loop for one FREE record.
func (m *Mux) freeChunk(ctx context.Context, ids []uint64) (uint64, error) {
	const op = "Free"
	m.ops.begin()
	defer m.ops.end()
	for {
		seqs := m.keep.seqs(ids)
		c, gen, err := m.startRequest(op, false, false)
		if err == nil {
			// keep: the session keeps a handle of one of the pages.
			err = c.send(ctx, op, fdchan.FreeReq{ReqID: c.req, PageIDs: ids, Keep: m.handles.Keeps(ids)})
		}
		if err == nil {
			var rep fdchan.Reply
			rep, err = c.await(ctx, op, func(r fdchan.Reply) {
				if r.Code == 0 {
					m.keep.release(seqs)
				}
			})
			if err == nil {
				m.keep.release(seqs)
				m.markStandby(ids, false)
				return rep.Value, nil
			}
		}
		if !m.resumable || !errors.Is(err, errs.ErrUnavailable) {
			return 0, err
		}
		// The daemon is away (resuming, or the channel hung up before or
		// after the FREE went out): the Free succeeds, checked as the
		// daemon would, and the pages are not claimed at the next resume,
		// which frees them (docs/protocol.md, "Free while the daemon is
		// away").
		if bad := checkAwayFree(ids, seqs); bad != nil {
			return 0, bad
		}
		m.mu.Lock()
		deferred := m.closed || m.resumeErr != nil || gen == m.gen
		if deferred {
			m.keep.deferSeqs(seqs)
		}
		m.mu.Unlock()
		if deferred {
			m.markStandby(ids, false)
			return uint64(len(ids)), nil
		}
		// A resume completed during the call and claimed these pages:
		// free them at the daemon that has them now.
	}
}

// Standby sends FREE records with the standby flag (docs/protocol.md,
// "Standby pages"), at most fdchan.MaxFreeIDs ids each: the pages stay the
// session's, mapped, counted as standby by the daemon. It is checked as a
// Free (all or nothing for each record) and returns the pages named.
// Unlike a Free it does not succeed while the daemon is away (nothing to
// defer: the pages stay held either way, and the restarted daemon counts
// them in use): it fails with ErrUnavailable then. The keep flag is never
// set (standby wins: nothing is given back).
func (m *Mux) Standby(ctx context.Context, ids []uint64) (uint64, error) {
	const op = "Standby"
	if len(ids) == 0 {
		return 0, errs.New(errs.ErrInvalidArgument, op, "page_ids is empty: name the pages to keep as standby")
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return 0, errs.New(errs.ErrFailedPrecondition, op, "session %d is closed", m.id)
	}
	m.mu.Unlock()
	var named uint64
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		c, _, err := m.startRequest(op, false, false)
		if err != nil {
			return named, err
		}
		chunk := ids[i:min(i+fdchan.MaxFreeIDs, len(ids))]
		if err := c.send(ctx, op, fdchan.FreeReq{ReqID: c.req, PageIDs: chunk, Standby: true}); err != nil {
			return named, err
		}
		rep, err := c.await(ctx, op, nil)
		if err != nil {
			return named, err
		}
		named += rep.Value
		m.markStandby(chunk, true)
	}
	return named, nil
}

// markStandby records held pages as kept as standby (on) or not.
func (m *Mux) markStandby(ids []uint64, on bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, id := range ids {
		if on {
			m.standby[id] = struct{}{}
		} else {
			delete(m.standby, id)
		}
	}
}

// standbyAmong returns the ids of `ids` kept as standby, minus `except`.
func (m *Mux) standbyAmong(ids, except []uint64) []uint64 {
	skip := make(map[uint64]bool, len(except))
	for _, id := range except {
		skip[id] = true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []uint64
	for _, id := range ids {
		if _, ok := m.standby[id]; ok && !skip[id] {
			out = append(out, id)
		}
	}
	return out
}

// Use sends USE records naming standby pages the session uses again, and
// waits for nothing: each has a request id of its own that nobody waits
// for, so its REPLY is dropped (docs/protocol.md, "Standby pages": the
// record only corrects the daemon's books). Nothing is sent while the
// session is closed, ended or resuming (a resumed session's pages are all
// in use at the restarted daemon); a send that fails is only logged. It
// returns the USE records sent.
func (m *Mux) Use(ids []uint64) int {
	m.markStandby(ids, false)
	m.mu.Lock()
	ch := m.ch
	if ch == nil || m.closed || m.resuming || m.endErr != nil || m.resumeErr != nil {
		m.mu.Unlock()
		return 0
	}
	m.mu.Unlock()
	sent := 0
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		chunk := ids[i:min(i+fdchan.MaxFreeIDs, len(ids))]
		if err := ch.Send(fdchan.UseReq{ReqID: m.reqs.nextID(), PageIDs: chunk}, nil, time.Now().Add(time.Second)); err != nil {
			m.log.Warn("kvcached: sending USE failed (the daemon's books count the pages as standby)", "pages", len(chunk), "err", err)
			return sent
		}
		sent++
	}
	return sent
}

// checkAwayFree is the daemon's check of a Free, made by the client while
// the daemon is away: all or nothing, every page held (seqs names the
// held ones), no id twice.
func checkAwayFree(ids []uint64, seqs map[uint64]uint64) error {
	seen := make(map[uint64]bool, len(ids))
	for _, id := range ids {
		if seen[id] {
			return errs.New(errs.ErrInvalidArgument, "Free", "page %d is named twice", id)
		}
		seen[id] = true
		if _, ok := seqs[id]; !ok {
			return errs.New(errs.ErrNotFound, "Free", "page %d is not held by this session (checked by the client: the daemon is away)", id)
		}
	}
	return nil
}

// CloseRequest sends CLOSE and waits for its REPLY (the daemon then
// closes the channel). A channel that ended first is not an error: the
// session ended with it.
func (m *Mux) CloseRequest(ctx context.Context) error {
	const op = "CloseSession"
	c, _, err := m.startRequest(op, true, false)
	if err == nil {
		err = c.send(ctx, op, fdchan.CloseReq{ReqID: c.req})
		if err == nil {
			_, err = c.await(ctx, op, nil)
		}
	}
	if err == nil || errs.IsAny(err, errs.ErrClosed, errs.ErrFailedPrecondition, errs.ErrNotFound) {
		return nil
	}
	if errors.Is(err, errs.ErrUnavailable) && m.Err() != nil {
		return nil
	}
	return err
}

// Answer sends an ANSWER record (its ReqID is set here) and returns the
// REPLY's value: the bytes the daemon's books show the session holding on
// the reclaim's device.
func (m *Mux) Answer(ctx context.Context, rec fdchan.AnswerReq) (uint64, error) {
	const op = "AnswerReclaim"
	if len(rec.Reason) > fdchan.MaxReason {
		return 0, errs.New(errs.ErrInvalidArgument, op, "the reason is %d bytes, at most %d", len(rec.Reason), fdchan.MaxReason)
	}
	c, _, err := m.startRequest(op, false, false)
	if err != nil {
		return 0, err
	}
	rec.ReqID = c.req
	if err := c.send(ctx, op, rec); err != nil {
		return 0, err
	}
	rep, err := c.await(ctx, op, nil)
	if err != nil {
		return 0, err
	}
	return rep.Value, nil
}

// dropOrphanLocked gives back an allocation whose Allocate call failed on
// this side (its context ended) after the daemon had already sent it.
func (m *Mux) dropOrphanLocked(o orphan) {
	ids, ok := m.reqs.takeOrphan(o)
	if !ok || m.closed {
		return
	}
	m.log.Info("kvcached: freeing pages of an allocation nobody waits for", "allocation_id", o.key.id, "pages", len(ids))
	m.giveBackLocked(ids)
}

// giveBackLocked sends FREE records for pages nobody waits for, at once
// and without waiting for their REPLY (which forgets the pages' kept
// descriptors when it comes). It runs under m.mu, on the reader goroutine
// or a caller's: the send is bounded by one second. While the session is
// resuming the pages are simply not claimed, which frees them.
func (m *Mux) giveBackLocked(ids []uint64) {
	if m.ch == nil || m.resuming || m.endErr != nil || m.resumeErr != nil {
		m.keep.deferIDs(ids)
		return
	}
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		chunk := ids[i:min(i+fdchan.MaxFreeIDs, len(ids))]
		seqs := m.keep.seqs(chunk)
		req, _ := m.reqs.add(m.gen, func(r fdchan.Reply) {
			if r.Code == 0 {
				m.keep.release(seqs)
			} else {
				m.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "code", r.Code, "message", r.Message)
			}
		})
		rec := fdchan.FreeReq{ReqID: req, PageIDs: chunk, Keep: m.handles.Keeps(chunk)}
		if err := m.ch.Send(rec, nil, time.Now().Add(time.Second)); err != nil {
			m.reqs.remove(req)
			m.keep.deferIDs(chunk)
			m.log.Warn("kvcached: giving back pages nobody waits for failed", "pages", len(chunk), "err", err)
		}
	}
}
