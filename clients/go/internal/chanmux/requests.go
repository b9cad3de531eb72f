package chanmux

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
)

// Requests on the fd channel (docs/protocol.md, "Requests on the channel"):
// ALLOCATE, FREE, CLOSE and ANSWER records on the session's own fd
// channel; no token travels, the kernel names the sender. Every request
// has an id of its own; the reader goroutine hands each REPLY to the
// goroutine waiting for it. An ALLOCATE's pages arrive as PAGES records
// with allocation id req_id|AllocBit, all before its REPLY, so they are
// complete when the REPLY is read. After a resume the requests go on the
// new channel.

// waiter is a request waiting for its REPLY.
type waiter struct {
	gen   uint64
	done  chan struct{} // closed by the reader with reply set
	reply fdchan.Reply
	// late is set when the caller gave up (its context ended) before the
	// answer: the reader calls it, under m.mu, when the REPLY arrives.
	late func(fdchan.Reply)
}

// chanCall is one request in flight on a channel.
type chanCall struct {
	ch   *fdchan.Conn
	gen  uint64
	lost chan struct{}
	req  uint64
	w    *waiter
}

// startRequest registers a request on the current fd channel. setup runs
// under m.mu with the request id. closing allows the CLOSE of Close.
// On error it returns the channel generation the call would have used.
func (m *Mux) startRequest(op string, closing bool, setup func(req uint64)) (*chanCall, uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.resumeErr != nil {
		return nil, m.gen, m.resumeErr
	}
	if (m.closed && !closing) || m.endErr != nil {
		return nil, m.gen, m.closedErrLocked(op)
	}
	select {
	case <-m.readerDone:
		return nil, m.gen, m.closedErrLocked(op)
	default:
	}
	if m.resuming {
		return nil, m.gen, m.unavailableLocked(op, "")
	}
	m.reqSeq++
	c := &chanCall{ch: m.ch, gen: m.gen, lost: m.lost, req: m.reqSeq, w: &waiter{gen: m.gen, done: make(chan struct{})}}
	m.waiters[c.req] = c.w
	if setup != nil {
		setup(c.req)
	}
	return c, c.gen, nil
}

// send sends the request's record; on failure the waiter is removed and
// undo runs (under m.mu). Nothing was sent then.
func (m *Mux) send(ctx context.Context, op string, c *chanCall, r fdchan.Record, undo func()) error {
	err := c.ch.SendContext(ctx, r)
	if err == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.waiters, c.req)
	if undo != nil {
		undo()
	}
	switch {
	case ctx.Err() != nil:
		return errs.FromStatus(op, ctx.Err())
	case m.endErr != nil || (m.closed && op != "CloseSession"):
		return m.closedErrLocked(op)
	case m.resumable:
		return m.unavailableLocked(op, "sending on the fd channel: %v", err)
	}
	return errs.New(errs.ErrUnavailable, op, "sending on the fd channel: %v", err)
}

// await waits for the request's REPLY. A REPLY with a non-zero code is
// mapped like a gRPC status (RPCErr, errs.FromStatus). When ctx ends first
// the request is abandoned: abandon runs under m.mu, and late (if not nil)
// runs under m.mu when the REPLY comes.
func (m *Mux) await(ctx context.Context, op string, c *chanCall, abandon func(), late func(fdchan.Reply)) (fdchan.Reply, error) {
	select {
	case <-c.w.done:
	case <-ctx.Done():
	case <-c.lost:
	case <-m.readerDone:
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
	case <-m.readerDone:
		delete(m.waiters, c.req)
		return fdchan.Reply{}, m.closedErrLocked(op)
	case <-c.lost:
		delete(m.waiters, c.req)
		return fdchan.Reply{}, m.unavailableLocked(op, "the fd channel hung up before the answer")
	default:
	}
	// The caller's context ended: the REPLY still comes, later.
	if abandon != nil {
		abandon()
	}
	c.w.late = late
	if late == nil {
		c.w.late = func(fdchan.Reply) {}
	}
	return fdchan.Reply{}, errs.FromStatus(op, ctx.Err())
}

// replied is the reader's side: hand a REPLY to its waiter.
func (m *Mux) replied(r fdchan.Reply) {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := m.waiters[r.ReqID]
	if w == nil || w.gen != m.gen {
		m.log.Debug("kvcached: REPLY to no request on this fd channel", "req_id", r.ReqID, "code", r.Code)
		return
	}
	delete(m.waiters, r.ReqID)
	key := allocKey{m.gen, r.ReqID | fdchan.AllocBit}
	if pa := m.allocs[key]; pa != nil {
		pa.replied = true
		if r.Code == 0 && w.late == nil {
			// Once the REPLY is read the pages are the caller's, even if
			// an ERROR or a hang-up follows at once (finish and resume do
			// not touch them; their kept duplicates stay in m.keep).
			delete(m.allocs, key)
		}
	}
	w.reply = r
	close(w.done)
	if w.late != nil {
		w.late(r)
	}
}

// dropWaitersLocked forgets the requests of channels before the current
// one (their callers are woken by lost or readerDone).
func (m *Mux) dropWaitersLocked() {
	for id, w := range m.waiters {
		if w.gen != m.gen || m.endErr != nil {
			delete(m.waiters, id)
		}
	}
}

// discardAllocLocked forgets a channel allocation that will not be
// returned: its descriptors are closed and its pages not kept for resume.
func (m *Mux) discardAllocLocked(key allocKey, pa *pendingAlloc) {
	if m.allocs[key] == pa {
		delete(m.allocs, key)
	}
	for j, fd := range pa.fds {
		if fd >= 0 {
			closeFD(fd)
			pa.fds[j] = -1
			if k, ok := m.keep[pa.ids[j]]; ok {
				closeFD(k.fd)
				delete(m.keep, pa.ids[j])
			}
		}
	}
}

// Allocation is what an ALLOCATE request brought: the pages' ids and
// descriptors, in order (the caller owns the descriptors).
type Allocation struct {
	ID        uint64 // allocation id: the request id | fdchan.AllocBit
	IDs       []uint64
	FDs       []int
	HeldBytes uint64 // the REPLY's value: bytes held on the device afterwards
}

// Allocate sends ALLOCATE (its ReqID is set here) and waits for its pages
// and REPLY. A caller whose ctx ends gets its error at once; the pages,
// when they come, are given back with FREE.
func (m *Mux) Allocate(ctx context.Context, rec fdchan.AllocateReq) (*Allocation, error) {
	const op = "Allocate"
	m.pageOpBegin()
	defer m.pageOpEnd()
	var key allocKey
	var pa *pendingAlloc
	c, _, err := m.startRequest(op, false, func(id uint64) {
		key = allocKey{m.gen, id | fdchan.AllocBit}
		pa = &pendingAlloc{done: make(chan struct{}), claimed: true}
		m.allocs[key] = pa
		m.inflight++
	})
	if err != nil {
		return nil, err
	}
	defer m.allocateDone()
	rec.ReqID = c.req
	if err := m.send(ctx, op, c, rec, func() { m.discardAllocLocked(key, pa) }); err != nil {
		return nil, err
	}
	rep, err := m.await(ctx, op, c,
		func() { pa.claimed = false }, // allocateDone (or deliver) gives the pages back once complete
		func(r fdchan.Reply) {
			if m.allocs[key] != pa {
				return // given back already
			}
			if r.Code == 0 && pa.total > 0 && pa.received == pa.total {
				m.dropOrphanLocked(key, pa)
			} else {
				m.discardAllocLocked(key, pa)
			}
		})
	m.mu.Lock()
	if err != nil {
		if m.allocs[key] == pa && pa.claimed { // a refusal (or the channel ended): nothing to give back
			m.discardAllocLocked(key, pa)
		}
		m.mu.Unlock()
		return nil, err
	}
	complete := pa.total == int(rec.NumPages) && pa.received == pa.total
	if !complete {
		// A REPLY OK before all the pages: the daemon broke the protocol.
		m.discardAllocLocked(key, pa)
		err := errs.New(errs.ErrProtocol, op, "request %d: %d of %d pages arrived before the answer", c.req, pa.received, rec.NumPages)
		if c.gen == m.gen { // (a REPLY of a channel since replaced ends nothing now)
			m.protocolFailureLocked(c.ch, err)
		}
		m.mu.Unlock()
		return nil, err
	}
	m.mu.Unlock()
	return &Allocation{ID: key.id, IDs: pa.ids, FDs: pa.fds, HeldBytes: rep.Value}, nil
}

// protocolFailureLocked ends the session after a protocol error a caller
// found: calls fail with err from now on, and the channel is closed (the
// daemon ends the session; the reader sees the close and does not resume).
func (m *Mux) protocolFailureLocked(ch *fdchan.Conn, err error) {
	if m.endErr == nil {
		m.endErr = err
	}
	ch.Close()
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
	m.pageOpBegin()
	defer m.pageOpEnd()
	for {
		seqs := m.keptSeqs(ids)
		c, gen, err := m.startRequest(op, false, nil)
		if err == nil {
			err = m.send(ctx, op, c, fdchan.FreeReq{ReqID: c.req, PageIDs: ids}, nil)
		}
		if err == nil {
			var rep fdchan.Reply
			rep, err = m.await(ctx, op, c, nil, func(r fdchan.Reply) {
				if r.Code == 0 {
					m.unkeepSeqsLocked(seqs)
				}
			})
			if err == nil {
				m.unkeep(seqs)
				return rep.Value, nil
			}
		}
		if !m.resumable || !errors.Is(err, errs.ErrUnavailable) {
			return 0, err
		}
		// The daemon is away (resuming, or the channel hung up after the
		// FREE went out): the Free succeeds, checked as the daemon would,
		// and the pages are not claimed at the next resume, which frees
		// them (docs/protocol.md, "Free while the daemon is away").
		if bad := checkAwayFree(ids, seqs); bad != nil {
			return 0, bad
		}
		if m.deferFree(gen, seqs) {
			return uint64(len(ids)), nil
		}
		// A resume completed during the call and claimed these pages:
		// free them at the daemon that has them now.
	}
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
	c, _, err := m.startRequest(op, true, nil)
	if err == nil {
		err = m.send(ctx, op, c, fdchan.CloseReq{ReqID: c.req}, nil)
		if err == nil {
			_, err = m.await(ctx, op, c, nil, nil)
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
	c, _, err := m.startRequest(op, false, nil)
	if err != nil {
		return 0, err
	}
	rec.ReqID = c.req
	if err := m.send(ctx, op, c, rec, nil); err != nil {
		return 0, err
	}
	rep, err := m.await(ctx, op, c, nil, nil)
	if err != nil {
		return 0, err
	}
	return rep.Value, nil
}

// allocateDone: an Allocate call returned. When none is left in flight,
// complete allocations nobody claimed are given back.
func (m *Mux) allocateDone() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.inflight--
	if m.inflight > 0 {
		return
	}
	for key, pa := range m.allocs {
		if !pa.claimed && pa.total > 0 && pa.received == pa.total {
			m.dropOrphanLocked(key, pa)
		}
	}
}
