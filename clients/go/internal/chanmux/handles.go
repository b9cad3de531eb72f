package chanmux

// Kept handles (docs/protocol.md, "Kept handles"): a session may keep the
// imported handle of a page it frees, to map the page again without an
// import when it comes back. The cache itself belongs to the session's
// mappers (the kvcached package: CUDA devices only); the Mux tells it what
// the fd channel says and when its pages stop being promises:
//
//   - a FREE carries keep when the cache keeps a handle of any page it
//     names (Mux.Free, and the pages nobody waits for);
//   - a DROP is answered at once by the reader: the handles of the pages
//     named are released, then DROPPED names every page of the DROP (the
//     REPLY to it is waited for by nobody);
//   - when the session ends (CLOSE, GOODBYE, ERROR, hang-up) every handle
//     is released, and so before a resume claims pages (a restarted daemon
//     never saw the FREEs, and its page ids are no promise about the old
//     daemon's pages).

// Handles is a session's cache of kept handles, keyed by page id. Its
// methods are called from the reader goroutine and from callers'
// goroutines (Keeps also under the Mux's lock, when pages nobody waits
// for are given back), and may call the CUDA driver; they must not call
// the Mux.
type Handles interface {
	// Keeps reports whether a handle of any of these pages is kept.
	Keeps(ids []uint64) bool
	// Drop releases the kept handles of these pages (pages it keeps no
	// handle of are nothing to it).
	Drop(ids []uint64)
	// Reset releases every kept handle. Only pages of channel generation
	// gen (Allocation.Gen) may be kept or mapped from a handle from now
	// on; with final, none (the session ended).
	Reset(gen uint64, final bool)
}

// noHandles keeps nothing (a Mux without Config.Handles).
type noHandles struct{}

func (noHandles) Keeps([]uint64) bool { return false }
func (noHandles) Drop([]uint64)       {}
func (noHandles) Reset(uint64, bool)  {}
