package kvcached

import (
	"log/slog"
	"os"
	"strconv"
	"sync"

	"github.com/kvcached/kvcached-service/clients/go/internal/cuda"
)

// Kept handles (docs/protocol.md, "Kept handles"). On a GPU a client's
// import of a page and the release of the imported handle cost about as
// much as making the page in-process; a page that comes back to the same
// session need not be imported again if the session kept its handle. A
// session keeps the handle of each CUDA page it imports (not host pages:
// their mapping costs one mmap either way), up to KVCACHED_KEEP_HANDLES
// pages (default 8192; 0: never keep), only when the daemon offers it
// (GetInfo().fd_channel_keep_handles). A page imported while the cache is
// full is released after it is mapped, as without a cache, so the cache
// never evicts (and never sends DROPPED on its own). The Mux
// (internal/chanmux, handles.go) tells the cache what the fd channel says:
// a FREE carries keep when a handle of any page it names is kept, a DROP
// releases the handles named, and every handle is released when the
// session ends and before a resume claims pages.

const defaultKeepHandles = 8192

// keepLimitFromEnv is KVCACHED_KEEP_HANDLES (default 8192; a value that is
// not a whole number >= 0 is logged and the default used).
func keepLimitFromEnv(log *slog.Logger) int {
	v, ok := os.LookupEnv(EnvKeepHandles)
	if !ok || v == "" {
		return defaultKeepHandles
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		log.Warn("kvcached: ignoring "+EnvKeepHandles+": not a whole number >= 0", "value", v, "default", defaultKeepHandles)
		return defaultKeepHandles
	}
	return n
}

// keptHandles is a session's cache of imported CUDA page handles, by page
// id, shared by the session's CUDA mappers (one per device). It implements
// chanmux.Handles. Its lock is held across the driver calls that map a run
// (a DROP's release waits for a map in progress: a handle is never
// released while a map is about to use it); no other lock is taken under
// it.
type keptHandles struct {
	limit int
	log   *slog.Logger

	mu   sync.Mutex
	on   bool   // keeping: the daemon offers it, limit > 0, the session has not ended
	gen  uint64 // the channel generation whose pages may be kept or mapped from a handle
	kept map[uint64]keptHandle
}

type keptHandle struct {
	h   cuda.Handle
	dev *cuda.Device // the device whose driver imported it (releases it)
}

func newKeptHandles(offered bool, limit int, log *slog.Logger) *keptHandles {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &keptHandles{limit: limit, log: log, on: offered && limit > 0, kept: map[uint64]keptHandle{}}
}

// mapRun maps a run of pages on dev (fds[i] is run.ids[i]'s descriptor,
// the caller closes it): a page whose handle is kept is mapped from it;
// the others are imported, and their handles kept while there is room
// (only pages of the current channel generation), else released after
// mapping. All or nothing, as cuda.Device.MapRunKept.
func (k *keptHandles) mapRun(dev *cuda.Device, addr, size uint64, fds []int, run pageRun) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := len(fds)
	modes := make([]cuda.MapMode, n)
	handles := make([]cuda.Handle, n)
	current := run.ids != nil && run.gen == k.gen
	room := 0
	if k.on && current {
		room = max(k.limit-len(k.kept), 0)
	}
	for i := range modes {
		if !current {
			continue // cuda.Import
		}
		e, ok := k.kept[run.ids[i]]
		switch {
		case ok && e.dev == dev:
			modes[i], handles[i] = cuda.Kept, e.h
		case !ok && room > 0:
			modes[i] = cuda.ImportKeep
			room--
		}
	}
	if err := dev.MapRunKept(addr, size, fds, modes, handles); err != nil {
		return err
	}
	for i, m := range modes {
		if m == cuda.ImportKeep {
			k.kept[run.ids[i]] = keptHandle{h: handles[i], dev: dev}
		}
	}
	return nil
}

// Keeps reports whether a handle of any of ids is kept (their FREE then
// carries keep).
func (k *keptHandles) Keeps(ids []uint64) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.kept) == 0 {
		return false
	}
	for _, id := range ids {
		if _, ok := k.kept[id]; ok {
			return true
		}
	}
	return false
}

// Drop releases the kept handles of ids (a DROP; ids not kept are nothing
// to it). It returns when they are released.
func (k *keptHandles) Drop(ids []uint64) {
	k.mu.Lock()
	var out []keptHandle
	for _, id := range ids {
		if e, ok := k.kept[id]; ok {
			out = append(out, e)
			delete(k.kept, id)
		}
	}
	k.mu.Unlock()
	k.release(out, "DROP")
}

// Reset releases every kept handle; from now on only pages of channel
// generation gen are kept, and with final none (the session ended).
func (k *keptHandles) Reset(gen uint64, final bool) {
	k.mu.Lock()
	out := make([]keptHandle, 0, len(k.kept))
	for id, e := range k.kept {
		out = append(out, e)
		delete(k.kept, id)
	}
	k.gen = gen
	if final {
		k.on = false
	}
	k.mu.Unlock()
	why := "resume"
	if final {
		why = "session end"
	}
	k.release(out, why)
}

// release releases handles no longer in the cache (nobody can map from
// them any more), grouped by device.
func (k *keptHandles) release(hs []keptHandle, why string) {
	if len(hs) == 0 {
		return
	}
	byDev := map[*cuda.Device][]cuda.Handle{}
	for _, e := range hs {
		byDev[e.dev] = append(byDev[e.dev], e.h)
	}
	for dev, handles := range byDev {
		if err := dev.Release(handles); err != nil {
			k.log.Warn("kvcached: releasing kept page handles failed", "handles", len(handles), "why", why, "err", err)
		}
	}
}

// count is how many handles are kept (tests).
func (k *keptHandles) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.kept)
}
