package chanmux

import (
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcached/kvcached-service/clients/go/internal/errs"
	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
)

// reader is the goroutine that owns the fd channel's receiving side: it
// hands each record to the part of the Mux it is for, resumes a resumable
// session whose channel hung up, and ends the session.
type reader struct {
	m    *Mux
	done chan struct{} // closed when the session has ended
}

// loop reads the channel until the session ends. When a resumable
// session's channel hangs up (the daemon died) it resumes the session
// (resume.go) and goes on reading the new channel.
func (rd *reader) loop(ch *fdchan.Conn) {
	m := rd.m
	defer m.wg.Done()
	for {
		end, hangup := rd.readChannel(ch)
		if hangup && m.resumable {
			next, err := m.res.run(ch, end)
			if next != nil {
				ch = next
				continue
			}
			if err != nil {
				end = err
			}
		}
		rd.finish(ch, end)
		return
	}
}

// readChannel reads records until the channel ends; hangup reports an end
// of stream or a read error rather than a record that ended the session.
func (rd *reader) readChannel(ch *fdchan.Conn) (end error, hangup bool) {
	m := rd.m
	for end == nil {
		r, err := ch.Recv()
		switch r := r.(type) {
		case fdchan.Pages:
			end = rd.deliver(r)
		case fdchan.Reply:
			rd.replied(r)
		case fdchan.Drop:
			rd.drop(ch, r)
		case fdchan.Error:
			end = errs.FromStatus("fd channel", status.Error(codes.Code(r.Code), r.Message))
		case fdchan.Goodbye:
			end = errs.Ended("fd channel", "session %d ended: the daemon ended it (GOODBYE: CloseSession or shutdown)", m.id)
		case fdchan.Hello:
			end = errs.New(errs.ErrProtocol, "fd channel", "second HELLO on one channel")
		case nil:
			m.mu.Lock()
			ended := m.endErr // a protocol error found by a caller, which closed the channel
			m.mu.Unlock()
			switch {
			case ended != nil:
				end = ended
			case errors.Is(err, fdchan.ErrProtocol):
				end = errs.New(errs.ErrProtocol, "fd channel", "%v", err)
			case !m.resumable:
				end, hangup = errs.Ended("fd channel", "session %d ended: the daemon went away, and without a state dir "+
					"(kvcached-serve --state-dir) a daemon that restarts cannot resume it; open a new session (%v)", m.id, err), true
			default:
				end, hangup = errs.New(errs.ErrUnavailable, "fd channel", "the daemon closed the fd channel: %v", err), true
			}
		default:
			end = errs.New(errs.ErrProtocol, "fd channel", "unexpected record %T", r)
		}
	}
	return end, hangup
}

// deliver stashes a PAGES record's pages with their allocation (the
// stash: they arrive before the REPLY of their ALLOCATE). Pages nobody
// waits for are given back as soon as they are complete.
func (rd *reader) deliver(r fdchan.Pages) error {
	m := rd.m
	m.mu.Lock()
	defer m.mu.Unlock()
	o, err := m.reqs.deliver(m.gen, r, m.keep)
	if o != nil {
		m.dropOrphanLocked(*o)
	}
	return err
}

// replied hands a REPLY to its waiter.
func (rd *reader) replied(r fdchan.Reply) {
	m := rd.m
	m.mu.Lock()
	defer m.mu.Unlock()
	late, ok := m.reqs.reply(m.gen, r)
	if !ok {
		m.log.Debug("kvcached: REPLY to no request on this fd channel", "req_id", r.ReqID, "code", r.Code)
		return
	}
	if late != nil {
		late(r)
	}
}

// drop answers a DROP at once (docs/protocol.md, "DROP is answered at
// once"): the kept handles of its pages are released, then DROPPED names
// every page of the DROP, kept or not. Nobody waits for the REPLY to it
// (a REPLY to no request is dropped). A send that fails is only logged:
// the daemon ends a session that does not answer.
func (rd *reader) drop(ch *fdchan.Conn, r fdchan.Drop) {
	m := rd.m
	m.handles.Drop(r.PageIDs)
	req := m.reqs.nextID()
	if err := ch.Send(fdchan.DroppedReq{ReqID: req, PageIDs: r.PageIDs}, nil, time.Now().Add(time.Second)); err != nil {
		m.log.Warn("kvcached: answering DROP failed", "pages", len(r.PageIDs), "err", err)
	}
}

// finish ends the session for good: pending allocations and kept page
// descriptors are closed, done is closed.
func (rd *reader) finish(ch *fdchan.Conn, end error) {
	m := rd.m
	m.mu.Lock()
	closing := m.closed
	if m.endErr == nil {
		m.endErr = end
	}
	m.reqs.closeAll()
	m.keep.closeAll()
	if m.resuming {
		m.resuming = false
		close(m.resumed)
	}
	logged := m.resumeErr != nil // the resumer said why
	gen := m.gen
	m.mu.Unlock()
	m.handles.Reset(gen, true)
	if !closing && !logged {
		m.log.Warn("kvcached session ended by the daemon", "err", end)
	}
	ch.Close()
	close(rd.done)
}
