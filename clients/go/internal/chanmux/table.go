package chanmux

import (
	"sync"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
)

// table is the book of requests on the fd channel: the calls waiting for
// their REPLY, by request id, and the allocations whose pages arrive in
// PAGES records (the stash: they come before the REPLY of their ALLOCATE).
// Entries carry the fd channel generation they were made on.
//
// Its lock is taken under the Mux's (whose channel state decides which
// generation is current) and before the keeper's. It calls nothing of the
// Mux: what to do with an allocation nobody waits for, and a late REPLY's
// callback, are returned to the caller, which runs them under the Mux's
// lock.
type table struct {
	mu       sync.Mutex
	seq      uint64             // the last request id
	waiters  map[uint64]*waiter // request id -> the call waiting for its REPLY
	allocs   map[allocKey]*pendingAlloc
	inflight int // Allocate calls in progress
}

// waiter is a request waiting for its REPLY.
type waiter struct {
	gen   uint64
	done  chan struct{} // closed by the reader with reply set
	reply fdchan.Reply
	// late is set when the caller gave up (its context ended) before the
	// answer: the reader calls it, under the Mux's lock, when the REPLY
	// arrives.
	late func(fdchan.Reply)
}

// allocKey names a pending allocation: allocation ids start again at a
// restarted daemon, so they are qualified by the fd channel generation.
type allocKey struct{ gen, id uint64 }

type pendingAlloc struct {
	total    int
	ids      []uint64
	fds      []int
	received int
	claimed  bool
	replied  bool // an ALLOCATE request's REPLY came
}

func (pa *pendingAlloc) complete() bool { return pa.total > 0 && pa.received == pa.total }

// orphan is a complete allocation nobody waits for: the Mux gives it back.
type orphan struct {
	key allocKey
	pa  *pendingAlloc
}

func newTable() *table {
	return &table{waiters: map[uint64]*waiter{}, allocs: map[allocKey]*pendingAlloc{}}
}

// add registers a request on channel generation gen and returns its id.
func (t *table) add(gen uint64, late func(fdchan.Reply)) (uint64, *waiter) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	w := &waiter{gen: gen, done: make(chan struct{}), late: late}
	t.waiters[t.seq] = w
	return t.seq, w
}

// nextID takes a request id for a request nobody waits for (its REPLY,
// answering no request, is dropped).
func (t *table) nextID() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	return t.seq
}

// addAlloc stashes the allocation an ALLOCATE request req will bring.
func (t *table) addAlloc(gen, req uint64) (allocKey, *pendingAlloc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	key := allocKey{gen, req | fdchan.AllocBit}
	pa := &pendingAlloc{claimed: true}
	t.allocs[key] = pa
	t.inflight++
	return key, pa
}

// remove forgets a request whose REPLY will not be waited for.
func (t *table) remove(req uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.waiters, req)
}

// abandon: the caller of w gave up before the answer. The REPLY still
// comes: late (a no-op when nil) is called then. An allocation pa, when
// complete, is given back (it is no longer claimed).
func (t *table) abandon(w *waiter, pa *pendingAlloc, late func(fdchan.Reply)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if pa != nil {
		pa.claimed = false
	}
	if late == nil {
		late = func(fdchan.Reply) {}
	}
	w.late = late
}

// reply hands a REPLY of channel generation gen to its waiter and
// returns the waiter's late callback, if it has one (false: the REPLY
// answers no request on this channel).
func (t *table) reply(gen uint64, r fdchan.Reply) (late func(fdchan.Reply), ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	w := t.waiters[r.ReqID]
	if w == nil || w.gen != gen {
		return nil, false
	}
	delete(t.waiters, r.ReqID)
	key := allocKey{gen, r.ReqID | fdchan.AllocBit}
	if pa := t.allocs[key]; pa != nil {
		pa.replied = true
		if r.Code == 0 && w.late == nil {
			// Once the REPLY is read the pages are the caller's, even if
			// an ERROR or a hang-up follows at once (finish and resume do
			// not touch them; their kept duplicates stay with the keeper).
			delete(t.allocs, key)
		}
	}
	w.reply = r
	close(w.done)
	return w.late, true
}

// deliver stashes a PAGES record's pages (received on generation gen)
// with their allocation and keeps their duplicates. It returns the
// allocation when it is complete and nobody waits for it (the stash rule:
// such pages are given back as soon as they are complete).
func (t *table) deliver(gen uint64, r fdchan.Pages, k *keeper) (*orphan, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	key := allocKey{gen, r.AllocationID}
	pa := t.allocs[key]
	if pa == nil {
		pa = &pendingAlloc{}
		t.allocs[key] = pa
	}
	if pa.total == 0 {
		pa.total = int(r.Total)
		pa.ids = make([]uint64, pa.total)
		pa.fds = make([]int, pa.total)
		for i := range pa.fds {
			pa.fds[i] = -1
		}
	}
	if int(r.Total) != pa.total || int(r.FirstIndex)+len(r.FDs) > pa.total {
		fdchan.CloseFDs(r.FDs)
		return nil, errs.New(errs.ErrProtocol, "fd channel", "allocation %d: record %d+%d of %d does not fit", r.AllocationID, r.FirstIndex, len(r.FDs), r.Total)
	}
	for i, fd := range r.FDs {
		j := int(r.FirstIndex) + i
		if pa.fds[j] >= 0 {
			fdchan.CloseFDs(r.FDs[i:])
			return nil, errs.New(errs.ErrProtocol, "fd channel", "allocation %d: page index %d sent twice", r.AllocationID, j)
		}
		pa.ids[j], pa.fds[j] = r.PageIDs[i], fd
		pa.received++
		k.add(r.PageIDs[i], fd)
	}
	if pa.received == pa.total && !pa.claimed {
		return &orphan{key, pa}, nil
	}
	return nil, nil
}

// takeOrphan removes an allocation nobody waits for and closes its
// descriptors (their kept duplicates stay, until the FREE's REPLY). It
// returns the pages to give back; false when the allocation was taken
// already.
func (t *table) takeOrphan(o orphan) ([]uint64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.allocs[o.key] != o.pa {
		return nil, false
	}
	delete(t.allocs, o.key)
	for _, fd := range o.pa.fds {
		closeFD(fd)
	}
	return o.pa.ids, true
}

// lateReply is an abandoned ALLOCATE's REPLY: it returns the allocation
// when it is complete and answered OK (give it back); otherwise the pages
// that arrived are discarded.
func (t *table) lateReply(o orphan, ok bool, k *keeper) *orphan {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.allocs[o.key] != o.pa {
		return nil // given back already
	}
	if ok && o.pa.complete() {
		return &o
	}
	t.discardLocked(o, k)
	return nil
}

// take hands an answered allocation to its caller, who asked for want
// pages: its ids and descriptors, or (ok false) the number of pages that
// arrived before the answer when they are not all there (the allocation
// is discarded then).
func (t *table) take(o orphan, want int, k *keeper) (ids []uint64, fds []int, received int, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	pa := o.pa
	if pa.total != want || pa.received != pa.total {
		received = pa.received
		t.discardLocked(o, k)
		return nil, nil, received, false
	}
	return pa.ids, pa.fds, pa.received, true
}

// discard forgets an allocation that will not be returned (its request
// failed): its descriptors are closed and its pages not kept for resume.
// With unlessAbandoned, an allocation abandoned by its caller is left
// for the late REPLY to give back.
func (t *table) discard(o orphan, unlessAbandoned bool, k *keeper) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if unlessAbandoned && (t.allocs[o.key] != o.pa || !o.pa.claimed) {
		return
	}
	t.discardLocked(o, k)
}

func (t *table) discardLocked(o orphan, k *keeper) {
	if t.allocs[o.key] == o.pa {
		delete(t.allocs, o.key)
	}
	pa := o.pa
	for j, fd := range pa.fds {
		if fd >= 0 {
			closeFD(fd)
			pa.fds[j] = -1
			k.forget(pa.ids[j])
		}
	}
}

// allocateDone: an Allocate call returned. When none is left in flight,
// it returns the complete allocations nobody claimed (to give back).
func (t *table) allocateDone() []orphan {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.inflight--
	if t.inflight > 0 {
		return nil
	}
	var out []orphan
	for key, pa := range t.allocs {
		if !pa.claimed && pa.complete() {
			out = append(out, orphan{key, pa})
		}
	}
	return out
}

// dropUndelivered runs when the fd channel hung up: allocations not fully
// delivered are lost (what arrived is closed and not claimed at the
// resume), and so are ALLOCATE requests not answered yet. Complete
// allocations are left for their Allocate calls.
func (t *table) dropUndelivered(k *keeper) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for key, pa := range t.allocs {
		if pa.complete() && (key.id&fdchan.AllocBit == 0 || pa.replied) {
			continue
		}
		for j, fd := range pa.fds {
			if fd >= 0 {
				closeFD(fd)
				k.forget(pa.ids[j])
			}
		}
		delete(t.allocs, key)
	}
}

// dropStale forgets the requests of channels before generation gen, or
// every request when the session ended (their callers are woken by the
// channel's lost or the reader's done).
func (t *table) dropStale(gen uint64, ended bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, w := range t.waiters {
		if w.gen != gen || ended {
			delete(t.waiters, id)
		}
	}
}

// closeAll closes every stashed descriptor and forgets every request (the
// session ended).
func (t *table) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for key, pa := range t.allocs {
		for _, fd := range pa.fds {
			closeFD(fd)
		}
		delete(t.allocs, key)
	}
	clear(t.waiters)
}

// counts is how many allocations are stashed and requests wait.
func (t *table) counts() (allocs, waiters int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.allocs), len(t.waiters)
}
