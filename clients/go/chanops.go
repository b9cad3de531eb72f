package kvcached

import (
	"context"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Requests on the fd channel (docs/protocol.md, "Requests on the channel").
// When the daemon offers them (GetInfo().fd_channel_requests), Allocate,
// Free and Close are sent as ALLOCATE, FREE and CLOSE records on the
// session's own fd channel: no token travels, the kernel names the sender.
// Every request has an id of its own; the reader goroutine hands each
// REPLY to the goroutine waiting for it. An ALLOCATE's pages arrive as
// PAGES records with allocation id req_id|AllocBit, all before its REPLY,
// so they are complete when the REPLY is read. After a resume the requests
// go on the new channel. There is no gRPC page path: OpenSession refuses a
// daemon that does not offer the channel.

// waiter is a request waiting for its REPLY.
type waiter struct {
	gen   uint64
	done  chan struct{} // closed by the reader with reply set
	reply fdchan.Reply
	// late is set when the caller gave up (its context ended) before the
	// answer: the reader calls it, under s.mu, when the REPLY arrives.
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

// ChannelRequests reports whether the session's Allocate, Free and Close
// go over its fd channel: always, since this client dropped its gRPC page
// path (OpenSession refuses a daemon that does not offer the channel).
func (s *Session) ChannelRequests() bool { return true }

// startRequest registers a request on the current fd channel. setup runs
// under s.mu with the request id. closing allows the CLOSE of Close.
// On error it returns the channel generation the call would have used.
func (s *Session) startRequest(op string, closing bool, setup func(req uint64)) (*chanCall, uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resumeErr != nil {
		return nil, s.gen, s.resumeErr
	}
	if (s.closed && !closing) || s.endErr != nil {
		return nil, s.gen, s.closedErrLocked(op)
	}
	select {
	case <-s.readerDone:
		return nil, s.gen, s.closedErrLocked(op)
	default:
	}
	if s.resuming {
		return nil, s.gen, s.unavailableLocked(op, "")
	}
	s.reqSeq++
	c := &chanCall{ch: s.ch, gen: s.gen, lost: s.lost, req: s.reqSeq, w: &waiter{gen: s.gen, done: make(chan struct{})}}
	s.waiters[c.req] = c.w
	if setup != nil {
		setup(c.req)
	}
	return c, c.gen, nil
}

// send sends the request's record; on failure the waiter is removed and
// undo runs (under s.mu). Nothing was sent then.
func (s *Session) send(ctx context.Context, op string, c *chanCall, r fdchan.Record, undo func()) error {
	err := c.ch.SendContext(ctx, r)
	if err == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.waiters, c.req)
	if undo != nil {
		undo()
	}
	switch {
	case ctx.Err() != nil:
		return statusToError(op, ctx.Err())
	case s.endErr != nil || (s.closed && op != "CloseSession"):
		return s.closedErrLocked(op)
	case s.resumable:
		return s.unavailableLocked(op, "sending on the fd channel: %v", err)
	}
	return newError(ErrUnavailable, op, "sending on the fd channel: %v", err)
}

// await waits for the request's REPLY. A REPLY with a non-zero code is
// mapped like a gRPC status (rpcErr, statusToError). When ctx ends first
// the request is abandoned: abandon runs under s.mu, and late (if not nil)
// runs under s.mu when the REPLY comes.
func (s *Session) await(ctx context.Context, op string, c *chanCall, abandon func(), late func(fdchan.Reply)) (fdchan.Reply, error) {
	select {
	case <-c.w.done:
	case <-ctx.Done():
	case <-c.lost:
	case <-s.readerDone:
	}
	s.mu.Lock()
	select {
	case <-c.w.done:
		s.mu.Unlock()
		r := c.w.reply
		if r.Code != 0 {
			return r, s.rpcErr(op, c.gen, status.Error(codes.Code(r.Code), r.Message))
		}
		return r, nil
	default:
	}
	defer s.mu.Unlock()
	select {
	case <-s.readerDone:
		delete(s.waiters, c.req)
		return fdchan.Reply{}, s.closedErrLocked(op)
	case <-c.lost:
		delete(s.waiters, c.req)
		return fdchan.Reply{}, s.unavailableLocked(op, "the fd channel hung up before the answer")
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
	return fdchan.Reply{}, statusToError(op, ctx.Err())
}

// replied is the reader's side: hand a REPLY to its waiter.
func (s *Session) replied(r fdchan.Reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	w := s.waiters[r.ReqID]
	if w == nil || w.gen != s.gen {
		s.log.Debug("kvcached: REPLY to no request on this fd channel", "req_id", r.ReqID, "code", r.Code)
		return
	}
	delete(s.waiters, r.ReqID)
	key := allocKey{s.gen, r.ReqID | fdchan.AllocBit}
	if pa := s.allocs[key]; pa != nil {
		pa.replied = true
		if r.Code == 0 && w.late == nil {
			// Once the REPLY is read the pages are the caller's, even if
			// an ERROR or a hang-up follows at once (finish and resume do
			// not touch them; their kept duplicates stay in s.keep).
			delete(s.allocs, key)
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
func (s *Session) dropWaitersLocked() {
	for id, w := range s.waiters {
		if w.gen != s.gen || s.endErr != nil {
			delete(s.waiters, id)
		}
	}
}

// discardAllocLocked forgets a channel allocation that will not be
// returned: its descriptors are closed and its pages not kept for resume.
func (s *Session) discardAllocLocked(key allocKey, pa *pendingAlloc) {
	if s.allocs[key] == pa {
		delete(s.allocs, key)
	}
	for j, fd := range pa.fds {
		if fd >= 0 {
			closeFD(fd)
			pa.fds[j] = -1
			if k, ok := s.keep[pa.ids[j]]; ok {
				closeFD(k.fd)
				delete(s.keep, pa.ids[j])
			}
		}
	}
}

func (s *Session) allocateOnChannel(ctx context.Context, req *pb.AllocateRequest) (*Allocation, error) {
	const op = "Allocate"
	s.pageOpBegin()
	defer s.pageOpEnd()
	var key allocKey
	var pa *pendingAlloc
	c, _, err := s.startRequest(op, false, func(id uint64) {
		key = allocKey{s.gen, id | fdchan.AllocBit}
		pa = &pendingAlloc{done: make(chan struct{}), claimed: true}
		s.allocs[key] = pa
		s.inflight++
	})
	if err != nil {
		return nil, err
	}
	defer s.allocateDone()
	rec := fdchan.AllocateReq{ReqID: c.req, NumPages: req.GetNumPages(), Wait: req.GetWait(),
		Notify: req.GetNotifyWhenAvailable(), WaitTimeoutMs: req.GetWaitTimeoutMs(), Device: req.GetDevice()}
	if err := s.send(ctx, op, c, rec, func() { s.discardAllocLocked(key, pa) }); err != nil {
		return nil, err
	}
	rep, err := s.await(ctx, op, c,
		func() { pa.claimed = false }, // allocateDone (or deliver) gives the pages back once complete
		func(r fdchan.Reply) {
			if s.allocs[key] != pa {
				return // given back already
			}
			if r.Code == 0 && pa.total > 0 && pa.received == pa.total {
				s.dropOrphanLocked(key, pa)
			} else {
				s.discardAllocLocked(key, pa)
			}
		})
	s.mu.Lock()
	if err != nil {
		if s.allocs[key] == pa && pa.claimed { // a refusal (or the channel ended): nothing to give back
			s.discardAllocLocked(key, pa)
		}
		s.mu.Unlock()
		return nil, err
	}
	complete := pa.total == int(rec.NumPages) && pa.received == pa.total
	if !complete {
		// A REPLY OK before all the pages: the daemon broke the protocol.
		s.discardAllocLocked(key, pa)
		err := newError(ErrProtocol, op, "request %d: %d of %d pages arrived before the answer", c.req, pa.received, rec.NumPages)
		if c.gen == s.gen { // (a REPLY of a channel since replaced ends nothing now)
			s.protocolFailureLocked(c.ch, err)
		}
		s.mu.Unlock()
		return nil, err
	}
	s.mu.Unlock()
	a := &Allocation{ID: key.id, Device: rec.Device, HeldBytes: rep.Value}
	for _, d := range s.info.Devices {
		if d.UUID == rec.Device || rec.Device == "" {
			a.Device, a.PageSize = d.UUID, d.PageSize
			break
		}
	}
	for i, fd := range pa.fds {
		a.Pages = append(a.Pages, Page{ID: pa.ids[i], File: os.NewFile(uintptr(fd), fmt.Sprintf("kvcached-page-%d", pa.ids[i]))})
	}
	return a, nil
}

// protocolFailureLocked ends the session after a protocol error a caller
// found: calls fail with err from now on, and the channel is closed (the
// daemon ends the session; the reader sees the close and does not resume).
func (s *Session) protocolFailureLocked(ch *fdchan.Conn, err error) {
	if s.endErr == nil {
		s.endErr = err
	}
	ch.Close()
}

// freeOnChannel sends FREE records of at most fdchan.MaxFreeIDs ids. All
// or nothing holds for each record; the pages of records answered before
// a failure are freed (PagesFreed counts them).
func (s *Session) freeOnChannel(ctx context.Context, ids []uint64) (FreeResult, error) {
	if len(ids) == 0 {
		return FreeResult{}, newError(ErrInvalidArgument, "Free", "page_ids is empty: name the pages to free")
	}
	s.mu.Lock()
	if s.closed {
		// As the daemon answers a gRPC Free of a closed session.
		s.mu.Unlock()
		return FreeResult{}, newError(ErrFailedPrecondition, "Free", "session %d is closed", s.id)
	}
	s.mu.Unlock()
	var res FreeResult
	for i := 0; i < len(ids); i += fdchan.MaxFreeIDs {
		n, err := s.freeChunk(ctx, ids[i:min(i+fdchan.MaxFreeIDs, len(ids))])
		res.PagesFreed += n
		if err != nil {
			return res, err
		}
	}
	return res, nil
}

// freeChunk is Free's loop (session.go) for one FREE record.
func (s *Session) freeChunk(ctx context.Context, ids []uint64) (uint64, error) {
	const op = "Free"
	s.pageOpBegin()
	defer s.pageOpEnd()
	for {
		seqs := s.keptSeqs(ids)
		c, gen, err := s.startRequest(op, false, nil)
		if err == nil {
			err = s.send(ctx, op, c, fdchan.FreeReq{ReqID: c.req, PageIDs: ids}, nil)
		}
		if err == nil {
			var rep fdchan.Reply
			rep, err = s.await(ctx, op, c, nil, func(r fdchan.Reply) {
				if r.Code == 0 {
					s.unkeepSeqsLocked(seqs)
				}
			})
			if err == nil {
				s.unkeep(seqs)
				return rep.Value, nil
			}
		}
		if !s.resumable || !errors.Is(err, ErrUnavailable) {
			return 0, err
		}
		// The daemon is away (resuming, or the channel hung up after the
		// FREE went out): the Free succeeds, checked as the daemon would,
		// and the pages are not claimed at the next resume, which frees
		// them (docs/protocol.md, "Free while the daemon is away").
		if bad := checkAwayFree(ids, seqs); bad != nil {
			return 0, bad
		}
		if s.deferFree(gen, seqs) {
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
			return newError(ErrInvalidArgument, "Free", "page %d is named twice", id)
		}
		seen[id] = true
		if _, ok := seqs[id]; !ok {
			return newError(ErrNotFound, "Free", "page %d is not held by this session (checked by the client: the daemon is away)", id)
		}
	}
	return nil
}

// closeOnChannel sends CLOSE and waits for its REPLY (the daemon then
// closes the channel). A channel that ended first is not an error: the
// session ended with it.
func (s *Session) closeOnChannel(ctx context.Context) error {
	const op = "CloseSession"
	c, _, err := s.startRequest(op, true, nil)
	if err == nil {
		err = s.send(ctx, op, c, fdchan.CloseReq{ReqID: c.req}, nil)
		if err == nil {
			_, err = s.await(ctx, op, c, nil, nil)
		}
	}
	if err == nil || errorsIsAny(err, ErrClosed, ErrFailedPrecondition, ErrNotFound) {
		return nil
	}
	if errors.Is(err, ErrUnavailable) && s.Err() != nil {
		return nil
	}
	return err
}

// AnswerReclaim answers the reclaim request id (Reclaim.ID) at once with
// what the session could do: bytesGiven it gave back for it (already
// freed), bytesKept it keeps on that device, and why (at most 1024 bytes).
// It is an ANSWER record on the session's fd channel (docs/protocol.md,
// "The reclaim answer"): the request is settled, nobody waits for the
// rest, and the session is not asked again before the request's deadline.
// It returns the bytes the daemon's books show the session holding on the
// reclaim's device; ErrNotFound for an id this session was never sent (or
// one settled more than 10 minutes ago).
func (s *Session) AnswerReclaim(ctx context.Context, id, bytesGiven, bytesKept uint64, reason string) (heldBytes uint64, err error) {
	const op = "AnswerReclaim"
	if len(reason) > fdchan.MaxReason {
		return 0, newError(ErrInvalidArgument, op, "the reason is %d bytes, at most %d", len(reason), fdchan.MaxReason)
	}
	c, _, err := s.startRequest(op, false, nil)
	if err != nil {
		return 0, err
	}
	rec := fdchan.AnswerReq{ReqID: c.req, ReclaimID: id, BytesGiven: bytesGiven, BytesKept: bytesKept, Reason: reason}
	if err := s.send(ctx, op, c, rec, nil); err != nil {
		return 0, err
	}
	rep, err := s.await(ctx, op, c, nil, nil)
	if err != nil {
		return 0, err
	}
	return rep.Value, nil
}
