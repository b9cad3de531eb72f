package chanmux

import (
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
)

// keeper keeps a duplicate descriptor of every page a resumable session
// holds, to re-send it to a restarted daemon in ADOPT records, and the
// pages whose Free could not reach the daemon (deferred: the next resume
// does not claim them, which frees them). For a session that is not
// resumable it keeps nothing.
//
// Its lock is the innermost of the package: it is taken under the Mux's
// and the table's, and no other lock is taken under it.
type keeper struct {
	on  bool // the session is resumable
	log *slog.Logger

	mu       sync.Mutex
	keep     map[uint64]kept   // page id -> dup of its fd, for ADOPT
	seq      uint64            // numbers kept entries (page ids are lent again)
	deferred map[uint64]uint64 // page id -> kept seq: its Free could not reach the daemon
}

// kept is the duplicate descriptor of a page the session holds. The
// daemon lends a page again under the same id after a Free, possibly to
// another goroutine of this session while the Free's answer is on its way:
// seq tells the entries of one id apart.
type kept struct {
	fd  int
	seq uint64
}

func newKeeper(resumable bool, log *slog.Logger) *keeper {
	return &keeper{on: resumable, log: log, keep: map[uint64]kept{}, deferred: map[uint64]uint64{}}
}

// add keeps a duplicate of a page's descriptor.
func (k *keeper) add(id uint64, fd int) {
	if !k.on {
		return
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		// Without the duplicate the page cannot be claimed at resume: it is
		// given back then (the mapping stays valid, as for any Free).
		k.log.Warn("kvcached: cannot keep a duplicate page descriptor for resume", "page_id", id, "err", err)
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if old, ok := k.keep[id]; ok {
		closeFD(old.fd)
	}
	k.seq++
	k.keep[id] = kept{fd: dup, seq: k.seq}
	delete(k.deferred, id)
}

// seqs names the kept entries of pages about to be freed (nil when the
// session is not resumable).
func (k *keeper) seqs(ids []uint64) map[uint64]uint64 {
	if !k.on {
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	seqs := make(map[uint64]uint64, len(ids))
	for _, id := range ids {
		if e, ok := k.keep[id]; ok {
			seqs[id] = e.seq
		}
	}
	return seqs
}

// release forgets pages the daemon has taken back: the entries named by
// seqs before the Free, not a page lent again since.
func (k *keeper) release(seqs map[uint64]uint64) {
	if len(seqs) == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, seq := range seqs {
		if e, ok := k.keep[id]; ok && e.seq == seq {
			k.forgetLocked(id)
		}
	}
}

// forget closes a page's kept descriptor: the page is not claimed at a
// resume.
func (k *keeper) forget(id uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.forgetLocked(id)
}

func (k *keeper) forgetLocked(id uint64) {
	if e, ok := k.keep[id]; ok {
		closeFD(e.fd)
		delete(k.keep, id)
	}
	delete(k.deferred, id)
}

// deferIDs: pages the session gave up while it could not tell the daemon;
// the next resume does not claim them.
func (k *keeper) deferIDs(ids []uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, id := range ids {
		if e, ok := k.keep[id]; ok {
			k.deferred[id] = e.seq
		}
	}
}

// deferSeqs is deferIDs for the entries named by seqs (a Free's pages,
// not a page lent again since).
func (k *keeper) deferSeqs(seqs map[uint64]uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, seq := range seqs {
		if e, ok := k.keep[id]; ok && e.seq == seq {
			k.deferred[id] = seq
		}
	}
}

// adopt forgets the deferred pages (the old daemon may or may not have
// freed them: the new daemon forgets them, which frees them) and calls
// send with the pages held, in id order, and their kept descriptors. It
// returns the ids sent. send runs under the keeper's lock: a concurrent
// Free cannot close a descriptor that is being sent.
func (k *keeper) adopt(send func(ids []uint64, fds []int) error) ([]uint64, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, seq := range k.deferred {
		if e, ok := k.keep[id]; ok && e.seq == seq {
			k.forgetLocked(id)
		}
	}
	clear(k.deferred)
	ids := make([]uint64, 0, len(k.keep))
	for id := range k.keep {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	fds := make([]int, len(ids))
	for i, id := range ids {
		fds[i] = k.keep[id].fd
	}
	return ids, send(ids, fds)
}

// deferredAmong returns the pages of ids deferred now (freed while a
// resume that claimed them was in flight).
func (k *keeper) deferredAmong(ids []uint64) []uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []uint64
	for _, id := range ids {
		if _, ok := k.deferred[id]; ok {
			out = append(out, id)
		}
	}
	return out
}

// closeAll closes every kept descriptor (the session ended).
func (k *keeper) closeAll() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, e := range k.keep {
		closeFD(e.fd)
		delete(k.keep, id)
	}
}

// count is how many page descriptors are kept.
func (k *keeper) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.keep)
}

// String describes the kept and deferred pages (test diagnostics).
func (k *keeper) String() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return fmt.Sprintf("keep %v deferred %v", k.keep, k.deferred)
}
