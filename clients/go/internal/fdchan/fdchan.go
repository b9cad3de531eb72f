// Package fdchan implements the client side of the fd channel: the
// SOCK_SEQPACKET socket on which the daemon sends a HELLO with the channel
// secret, then page descriptors (SCM_RIGHTS) in PAGES records, and on which
// a client may send ALLOCATE, FREE, CLOSE, ANSWER and DROPPED requests
// answered by REPLY records (when GetInfo().fd_channel_requests is true),
// and on which the daemon asks for kept handles with DROP. The framing
// is specified in docs/protocol.md; kvcached_service/fdchannel.py is the
// daemon's implementation of the same format.
package fdchan

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Framing constants from docs/protocol.md.
const (
	Magic      = 0x4643564B // 'K','V','C','F' in memory order
	Version    = 1
	HeaderSize = 16
	MaxFDs     = 253 // SCM_MAX_FD
	SecretSize = 32

	TypeHello   = 1
	TypePages   = 2
	TypeError   = 3
	TypeGoodbye = 4
	TypeAdopt   = 5 // client to daemon, before ResumeSession
	// Requests on a session's own channel (client to daemon) and their
	// answer (daemon to client).
	TypeAllocate = 6
	TypeFree     = 7
	TypeClose    = 8
	TypeReply    = 9
	TypeAnswer   = 10 // a session's answer to a reclaim request
	// Kept handles (docs/protocol.md, "Kept handles").
	TypeDrop    = 11 // daemon to client: release your kept handles of these pages
	TypeDropped = 12 // client to daemon: it keeps no handle of these pages any more
	TypeUse     = 13 // client to daemon: standby pages in use again ("Standby pages")

	// AllocBit is set in the allocation id of the PAGES records that answer
	// an ALLOCATE record: allocation_id = req_id | AllocBit, so they never
	// collide with the ids of gRPC Allocate calls.
	AllocBit = uint64(1) << 63
	// MaxFreeIDs is the most page ids one FREE, DROPPED or USE record
	// carries.
	MaxFreeIDs = 16384
	// MaxDropIDs is the most page ids one DROP record carries (the spec's
	// max_drop_ids, 519): a DROP fits MaxRecord, the largest record the
	// daemon sends; the daemon splits a larger ask into several DROPs.
	MaxDropIDs = (MaxRecord - HeaderSize - dropFixed) / 8
	// ALLOCATE flags.
	AllocWait   = 1
	AllocNotify = 2
	// FreeKeep is FREE's flag keep: the sender keeps the imported handle
	// of every page it names (only to a daemon whose
	// GetInfo().fd_channel_keep_handles is true).
	FreeKeep = 1
	// FreeStandby is FREE's flag standby: the pages stay the session's,
	// mapped, as standby (only where GetInfo().fd_channel_standby;
	// chanmux.Mux.Standby sends it).
	FreeStandby = 2

	helloSize   = 56
	pagesFixed  = 24
	allocFixed  = 24
	freeFixed   = 16 // FREE, DROPPED and USE
	dropFixed   = 8
	closeSize   = 8
	replyFixed  = 24
	answerFixed = 32
	// MaxReason is the most bytes of an ANSWER's reason.
	MaxReason = 1024
	// MaxRecord is the largest record the daemon sends (a REPLY or ERROR
	// with its message, or a full PAGES record); as in fdchannel.py.
	MaxRecord = HeaderSize + 4096 + 64
)

// ErrProtocol marks a record that does not follow docs/protocol.md.
var ErrProtocol = errors.New("fd channel protocol error")

func protoErr(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, a...))
}

// Record is one of Hello, Pages, Error, Goodbye, Reply, Drop (daemon to
// client) or Adopt, AllocateReq, FreeReq, CloseReq, AnswerReq, DroppedReq,
// UseReq (client to daemon).
type Record interface{ recordType() uint16 }

// Hello is the first record on a channel.
type Hello struct {
	ChannelID uint64
	PID       uint32
	UID       uint32
	GID       uint32
	MaxFDs    uint32
	Secret    [SecretSize]byte
}

// Pages carries up to MaxFDs page descriptors of one allocation.
type Pages struct {
	AllocationID uint64
	FirstIndex   uint32
	Total        uint32
	PageIDs      []uint64
	FDs          []int // FDs[i] belongs to PageIDs[i]; the receiver owns them
}

// Error is sent instead of HELLO or before the daemon ends a session.
type Error struct {
	Code    uint32 // a gRPC status code
	Message string
}

// Goodbye: the daemon ended the session normally.
type Goodbye struct{}

// Adopt re-sends up to MaxFDs pages a client still holds to a restarted
// daemon, before ResumeSession. Same layout as Pages, with the id of the
// session being resumed in the first field.
type Adopt struct {
	SessionID  uint64
	FirstIndex uint32
	Total      uint32
	PageIDs    []uint64
	FDs        []int // FDs[i] is the page PageIDs[i]; the sender keeps them
}

// AllocateReq asks for NumPages pages on the session's own channel. They
// arrive as PAGES records with AllocationID = ReqID|AllocBit, all before
// the Reply.
type AllocateReq struct {
	ReqID         uint64
	NumPages      uint32
	Wait          bool   // let the daemon reclaim and wait
	Notify        bool   // MEMORY_AVAILABLE event if it fails for lack of memory
	WaitTimeoutMs uint32 // 0 = the daemon's default
	Device        string // UUID; "" = the daemon's first device
}

// FreeReq gives back 1..MaxFreeIDs pages.
type FreeReq struct {
	ReqID   uint64
	PageIDs []uint64
	// Keep: the sender keeps the imported handle of every page named
	// (flags bit 0). Decode sets it from Flags; Encode sets the bit when
	// Keep is true.
	Keep bool
	// Standby: the pages stay the session's, as standby (flags bit 1),
	// set by Decode; Encode sets the bit when it is true.
	Standby bool
	// Flags is the raw flags field as decoded (other bits are ignored);
	// Encode writes it, with FreeKeep and FreeStandby added when Keep and
	// Standby are set.
	Flags uint32
}

// UseReq: standby pages of the session in use again (docs/protocol.md,
// "Standby pages"). Same layout as DroppedReq. Sent by chanmux.Mux.Use,
// whose REPLY nobody waits for.
type UseReq struct {
	ReqID   uint64
	PageIDs []uint64
}

// DroppedReq: the session keeps no handle of these pages any more (the
// answer to a Drop, naming every page of it). Same layout as FreeReq.
type DroppedReq struct {
	ReqID   uint64
	PageIDs []uint64
}

// Drop asks the client to release every handle it kept of these pages
// (1..MaxDropIDs), then to say so with DroppedReq.
type Drop struct {
	PageIDs []uint64
}

// CloseReq ends the session; after its Reply the daemon closes the channel.
type CloseReq struct {
	ReqID uint64
}

// AnswerReq answers a reclaim request (a RECLAIM Watch event's id) on the
// session's own channel: the bytes given back for it (already freed), the
// bytes kept on that device, and why (at most MaxReason bytes). The
// daemon's Reply carries the bytes its books show the session holding on
// the reclaim's device.
type AnswerReq struct {
	ReqID      uint64
	ReclaimID  uint64
	BytesGiven uint64
	BytesKept  uint64
	Reason     string
}

// Reply answers a request record.
type Reply struct {
	ReqID   uint64
	Code    uint32 // a gRPC status code; 0 = OK
	Value   uint64 // ALLOCATE: bytes held on the device; FREE: pages freed; CLOSE: pages returned
	Message string // on errors
}

func (Hello) recordType() uint16   { return TypeHello }
func (Pages) recordType() uint16   { return TypePages }
func (Error) recordType() uint16   { return TypeError }
func (Goodbye) recordType() uint16 { return TypeGoodbye }
func (Adopt) recordType() uint16   { return TypeAdopt }

func (AllocateReq) recordType() uint16 { return TypeAllocate }
func (FreeReq) recordType() uint16     { return TypeFree }
func (CloseReq) recordType() uint16    { return TypeClose }
func (AnswerReq) recordType() uint16   { return TypeAnswer }
func (DroppedReq) recordType() uint16  { return TypeDropped }
func (UseReq) recordType() uint16      { return TypeUse }
func (Reply) recordType() uint16       { return TypeReply }
func (Drop) recordType() uint16        { return TypeDrop }

func frame(typ uint16, payload []byte) []byte {
	b := make([]byte, HeaderSize+len(payload))
	binary.LittleEndian.PutUint32(b[0:], Magic)
	binary.LittleEndian.PutUint16(b[4:], Version)
	binary.LittleEndian.PutUint16(b[6:], typ)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(payload)))
	copy(b[HeaderSize:], payload)
	return b
}

// Encode builds the bytes of a record (requests and ADOPT for the client;
// the daemon's records for tests and fakes). The fds of a Pages or Adopt
// record travel separately. It panics on a FreeReq, DroppedReq or Drop of
// more than MaxFreeIDs ids (Conn.Send checks first).
func Encode(r Record) []byte {
	switch r := r.(type) {
	case Hello:
		p := make([]byte, helloSize)
		binary.LittleEndian.PutUint64(p[0:], r.ChannelID)
		binary.LittleEndian.PutUint32(p[8:], r.PID)
		binary.LittleEndian.PutUint32(p[12:], r.UID)
		binary.LittleEndian.PutUint32(p[16:], r.GID)
		binary.LittleEndian.PutUint32(p[20:], r.MaxFDs)
		copy(p[24:], r.Secret[:])
		return frame(TypeHello, p)
	case Pages:
		return frame(TypePages, encodePages(r.AllocationID, r.FirstIndex, r.Total, r.PageIDs))
	case Adopt:
		return frame(TypeAdopt, encodePages(r.SessionID, r.FirstIndex, r.Total, r.PageIDs))
	case Error:
		p := make([]byte, 4+len(r.Message))
		binary.LittleEndian.PutUint32(p, r.Code)
		copy(p[4:], r.Message)
		return frame(TypeError, p)
	case Goodbye:
		return frame(TypeGoodbye, nil)
	case AllocateReq:
		p := make([]byte, allocFixed+len(r.Device))
		var flags uint32
		if r.Wait {
			flags |= AllocWait
		}
		if r.Notify {
			flags |= AllocNotify
		}
		binary.LittleEndian.PutUint64(p[0:], r.ReqID)
		binary.LittleEndian.PutUint32(p[8:], r.NumPages)
		binary.LittleEndian.PutUint32(p[12:], flags)
		binary.LittleEndian.PutUint32(p[16:], r.WaitTimeoutMs)
		binary.LittleEndian.PutUint32(p[20:], uint32(len(r.Device)))
		copy(p[allocFixed:], r.Device)
		return frame(TypeAllocate, p)
	case FreeReq:
		flags := r.Flags
		if r.Keep {
			flags |= FreeKeep
		}
		if r.Standby {
			flags |= FreeStandby
		}
		return frame(TypeFree, encodeIDs(r.ReqID, flags, r.PageIDs, "FREE"))
	case DroppedReq:
		return frame(TypeDropped, encodeIDs(r.ReqID, 0, r.PageIDs, "DROPPED"))
	case UseReq:
		return frame(TypeUse, encodeIDs(r.ReqID, 0, r.PageIDs, "USE"))
	case Drop:
		if len(r.PageIDs) > MaxDropIDs {
			panic(fmt.Sprintf("fdchan: DROP of %d page ids, at most %d", len(r.PageIDs), MaxDropIDs))
		}
		p := make([]byte, dropFixed+8*len(r.PageIDs))
		binary.LittleEndian.PutUint32(p[0:], uint32(len(r.PageIDs)))
		for i, id := range r.PageIDs {
			binary.LittleEndian.PutUint64(p[dropFixed+8*i:], id)
		}
		return frame(TypeDrop, p)
	case CloseReq:
		p := make([]byte, closeSize)
		binary.LittleEndian.PutUint64(p, r.ReqID)
		return frame(TypeClose, p)
	case AnswerReq:
		p := make([]byte, answerFixed+len(r.Reason))
		binary.LittleEndian.PutUint64(p[0:], r.ReqID)
		binary.LittleEndian.PutUint64(p[8:], r.ReclaimID)
		binary.LittleEndian.PutUint64(p[16:], r.BytesGiven)
		binary.LittleEndian.PutUint64(p[24:], r.BytesKept)
		copy(p[answerFixed:], r.Reason)
		return frame(TypeAnswer, p)
	case Reply:
		p := make([]byte, replyFixed+len(r.Message))
		binary.LittleEndian.PutUint64(p[0:], r.ReqID)
		binary.LittleEndian.PutUint32(p[8:], r.Code)
		binary.LittleEndian.PutUint64(p[16:], r.Value)
		copy(p[replyFixed:], r.Message)
		return frame(TypeReply, p)
	}
	panic(fmt.Sprintf("fdchan: unknown record %T", r))
}

// encodeIDs is the payload of FREE, DROPPED and USE: req_id, count, flags
// (DROPPED, USE: reserved, 0), page ids.
func encodeIDs(req uint64, flags uint32, ids []uint64, name string) []byte {
	if len(ids) > MaxFreeIDs {
		panic(fmt.Sprintf("fdchan: %s of %d page ids, at most %d", name, len(ids), MaxFreeIDs))
	}
	p := make([]byte, freeFixed+8*len(ids))
	binary.LittleEndian.PutUint64(p[0:], req)
	binary.LittleEndian.PutUint32(p[8:], uint32(len(ids)))
	binary.LittleEndian.PutUint32(p[12:], flags)
	for i, id := range ids {
		binary.LittleEndian.PutUint64(p[freeFixed+8*i:], id)
	}
	return p
}

func encodePages(first uint64, index, total uint32, ids []uint64) []byte {
	p := make([]byte, pagesFixed+8*len(ids))
	binary.LittleEndian.PutUint64(p[0:], first)
	binary.LittleEndian.PutUint32(p[8:], index)
	binary.LittleEndian.PutUint32(p[12:], uint32(len(ids)))
	binary.LittleEndian.PutUint32(p[16:], total)
	for i, id := range ids {
		binary.LittleEndian.PutUint64(p[pagesFixed+8*i:], id)
	}
	return p
}

// MalformedRequest is the error for a request record (ALLOCATE, FREE,
// CLOSE, ANSWER, DROPPED, USE) whose framing is sound and whose ReqID can be read but
// which breaks its type's own rules (the spec's on_malformed_request: the
// daemon answers it with REPLY INVALID_ARGUMENT and Error() as the
// message). It matches ErrProtocol with errors.Is: a client never receives
// requests, so for a client it is a protocol error like any other.
type MalformedRequest struct {
	Kind  string // "ALLOCATE", "FREE", "CLOSE", "ANSWER", "DROPPED", "USE"
	ReqID uint64
	Fault string
}

func (e *MalformedRequest) Error() string { return "malformed " + e.Kind + " record: " + e.Fault }

// Is makes errors.Is(err, ErrProtocol) true.
func (e *MalformedRequest) Is(target error) bool { return target == ErrProtocol }

func malformed(kind string, req uint64, format string, a ...any) error {
	return &MalformedRequest{Kind: kind, ReqID: req, Fault: fmt.Sprintf(format, a...)}
}

var typeNames = map[uint16]string{
	TypeHello: "HELLO", TypePages: "PAGES", TypeError: "ERROR", TypeGoodbye: "GOODBYE", TypeAdopt: "ADOPT",
	TypeAllocate: "ALLOCATE", TypeFree: "FREE", TypeClose: "CLOSE", TypeReply: "REPLY", TypeAnswer: "ANSWER",
	TypeDrop: "DROP", TypeDropped: "DROPPED", TypeUse: "USE",
}

// text decodes a message or reason: invalid UTF-8 is replaced, not an error.
func text(b []byte) string { return strings.ToValidUTF8(string(b), "\uFFFD") }

// Decode parses one record. nfds is the number of descriptors that arrived
// with it (the caller keeps ownership of them, also on error); a Pages
// record's FDs field is left for the caller to fill.
//
// Errors match ErrProtocol; a request record whose req_id could be read
// but which breaks its own rules is a *MalformedRequest (errors.As), as
// the spec classifies it (fdchannel.spec.json, on_malformed_request).
func Decode(data []byte, nfds int) (Record, error) {
	if len(data) < HeaderSize {
		return nil, protoErr("record of %d bytes is shorter than the %d-byte header", len(data), HeaderSize)
	}
	magic := binary.LittleEndian.Uint32(data[0:])
	version := binary.LittleEndian.Uint16(data[4:])
	typ := binary.LittleEndian.Uint16(data[6:])
	length := binary.LittleEndian.Uint32(data[8:])
	if magic != Magic {
		return nil, protoErr("bad magic 0x%08x", magic)
	}
	if version != Version {
		return nil, protoErr("unsupported fd protocol version %d", version)
	}
	p := data[HeaderSize:]
	if uint64(len(p)) != uint64(length) {
		return nil, protoErr("payload is %d bytes, header says %d", len(p), length)
	}
	name, known := typeNames[typ]
	if !known {
		return nil, protoErr("unknown record type %d", typ)
	}
	switch typ {
	case TypeAllocate, TypeFree, TypeClose, TypeAnswer, TypeDropped, TypeUse:
		return decodeRequest(typ, name, p, nfds)
	case TypeDrop:
		if len(p) < dropFixed {
			return nil, protoErr("DROP record too short (%d bytes)", len(p))
		}
		if nfds != 0 {
			return nil, protoErr("DROP record carries descriptors (%d)", nfds)
		}
		count := binary.LittleEndian.Uint32(p[0:])
		if count == 0 || count > MaxDropIDs || uint64(len(p)) != dropFixed+8*uint64(count) {
			return nil, protoErr("DROP record says %d page ids and has %d bytes of them", count, len(p)-dropFixed)
		}
		r := Drop{PageIDs: make([]uint64, count)}
		for i := range r.PageIDs {
			r.PageIDs[i] = binary.LittleEndian.Uint64(p[dropFixed+8*i:])
		}
		return r, nil
	case TypeHello:
		if len(p) != helloSize || nfds != 0 {
			return nil, protoErr("malformed HELLO (%d bytes, %d fds)", len(p), nfds)
		}
		h := Hello{
			ChannelID: binary.LittleEndian.Uint64(p[0:]),
			PID:       binary.LittleEndian.Uint32(p[8:]),
			UID:       binary.LittleEndian.Uint32(p[12:]),
			GID:       binary.LittleEndian.Uint32(p[16:]),
			MaxFDs:    binary.LittleEndian.Uint32(p[20:]),
		}
		copy(h.Secret[:], p[24:56])
		return h, nil
	case TypePages, TypeAdopt:
		if len(p) < pagesFixed {
			return nil, protoErr("%s record too short (%d bytes)", name, len(p))
		}
		count := binary.LittleEndian.Uint32(p[12:])
		if count == 0 || count > MaxFDs || uint64(len(p)) != pagesFixed+8*uint64(count) || int(count) != nfds {
			return nil, protoErr("%s record says %d pages, carries %d fds and %d bytes", name, count, nfds, len(p))
		}
		r := Pages{
			AllocationID: binary.LittleEndian.Uint64(p[0:]),
			FirstIndex:   binary.LittleEndian.Uint32(p[8:]),
			Total:        binary.LittleEndian.Uint32(p[16:]),
			PageIDs:      make([]uint64, count),
		}
		if uint64(r.FirstIndex)+uint64(count) > uint64(r.Total) {
			return nil, protoErr("%s record covers pages %d..%d of an allocation of %d", name, r.FirstIndex, uint64(r.FirstIndex)+uint64(count), r.Total)
		}
		for i := range r.PageIDs {
			r.PageIDs[i] = binary.LittleEndian.Uint64(p[pagesFixed+8*i:])
		}
		if typ == TypeAdopt {
			return Adopt{SessionID: r.AllocationID, FirstIndex: r.FirstIndex, Total: r.Total, PageIDs: r.PageIDs}, nil
		}
		return r, nil
	case TypeReply:
		if len(p) < replyFixed || nfds != 0 {
			return nil, protoErr("malformed REPLY (%d bytes, %d fds)", len(p), nfds)
		}
		return Reply{
			ReqID: binary.LittleEndian.Uint64(p[0:]), Code: binary.LittleEndian.Uint32(p[8:]),
			Value: binary.LittleEndian.Uint64(p[16:]), Message: text(p[replyFixed:]),
		}, nil
	case TypeError:
		if len(p) < 4 || nfds != 0 {
			return nil, protoErr("malformed ERROR (%d bytes, %d fds)", len(p), nfds)
		}
		return Error{Code: binary.LittleEndian.Uint32(p), Message: text(p[4:])}, nil
	}
	// TypeGoodbye
	if len(p) != 0 || nfds != 0 {
		return nil, protoErr("malformed GOODBYE (%d bytes, %d fds)", len(p), nfds)
	}
	return Goodbye{}, nil
}

// decodeRequest: no req_id is a protocol error; after that every fault is
// a *MalformedRequest naming it (the same words as the daemon's REPLY).
func decodeRequest(typ uint16, name string, p []byte, nfds int) (Record, error) {
	if len(p) < 8 {
		return nil, protoErr("%s record of %d payload bytes has no req_id", name, len(p))
	}
	req := binary.LittleEndian.Uint64(p)
	if nfds != 0 {
		return nil, malformed(name, req, "carries descriptors (%d); requests carry none", nfds)
	}
	switch typ {
	case TypeAllocate:
		if len(p) < allocFixed {
			return nil, malformed(name, req, "%d payload bytes, fewer than its fixed %d", len(p), allocFixed)
		}
		flags := binary.LittleEndian.Uint32(p[12:])
		devLen := binary.LittleEndian.Uint32(p[20:])
		if uint64(len(p)) != allocFixed+uint64(devLen) {
			return nil, malformed(name, req, "device_len %d but %d bytes of device", devLen, len(p)-allocFixed)
		}
		return AllocateReq{
			ReqID: req, NumPages: binary.LittleEndian.Uint32(p[8:]),
			Wait: flags&AllocWait != 0, Notify: flags&AllocNotify != 0,
			WaitTimeoutMs: binary.LittleEndian.Uint32(p[16:]), Device: text(p[allocFixed:]),
		}, nil
	case TypeFree, TypeDropped, TypeUse:
		if len(p) < freeFixed {
			return nil, malformed(name, req, "%d payload bytes, fewer than its fixed %d", len(p), freeFixed)
		}
		count := binary.LittleEndian.Uint32(p[8:])
		if count > MaxFreeIDs {
			return nil, malformed(name, req, "%d page ids, more than %d", count, MaxFreeIDs)
		}
		if uint64(len(p)) != freeFixed+8*uint64(count) {
			return nil, malformed(name, req, "count %d but %d bytes of page ids", count, len(p)-freeFixed)
		}
		ids := make([]uint64, count)
		for i := range ids {
			ids[i] = binary.LittleEndian.Uint64(p[freeFixed+8*i:])
		}
		switch typ {
		case TypeDropped:
			return DroppedReq{ReqID: req, PageIDs: ids}, nil
		case TypeUse:
			return UseReq{ReqID: req, PageIDs: ids}, nil
		}
		flags := binary.LittleEndian.Uint32(p[12:])
		return FreeReq{ReqID: req, PageIDs: ids, Keep: flags&FreeKeep != 0, Standby: flags&FreeStandby != 0, Flags: flags}, nil
	case TypeClose:
		if len(p) != closeSize {
			return nil, malformed(name, req, "%d payload bytes, not %d", len(p), closeSize)
		}
		return CloseReq{ReqID: req}, nil
	}
	// TypeAnswer
	if len(p) < answerFixed {
		return nil, malformed(name, req, "%d payload bytes, fewer than its fixed %d", len(p), answerFixed)
	}
	if len(p)-answerFixed > MaxReason {
		return nil, malformed(name, req, "a reason of %d bytes, more than %d", len(p)-answerFixed, MaxReason)
	}
	return AnswerReq{
		ReqID: req, ReclaimID: binary.LittleEndian.Uint64(p[8:]),
		BytesGiven: binary.LittleEndian.Uint64(p[16:]), BytesKept: binary.LittleEndian.Uint64(p[24:]),
		Reason: text(p[answerFixed:]),
	}, nil
}

// Conn is a client's end of the fd channel. Recv is for one goroutine;
// Send may be called from many (records are sent whole, one at a time).
type Conn struct {
	c      *net.UnixConn
	buf    []byte
	oob    []byte
	sendMu sync.Mutex // one Send at a time: the write deadline is per socket
}

// Dial connects to the daemon's fd socket (SOCK_SEQPACKET).
func Dial(path string) (*Conn, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	return NewConn(c), nil
}

// NewConn wraps a connected SOCK_SEQPACKET Unix socket.
func NewConn(c *net.UnixConn) *Conn {
	return &Conn{
		c:   c,
		buf: make([]byte, MaxRecord+1),
		oob: make([]byte, unix.CmsgSpace(MaxFDs*4)),
	}
}

// Recv reads one record. It returns io.EOF at end of stream. Descriptors of a malformed record are closed before the error is
// returned; descriptors are received close-on-exec (Go's ReadMsgUnix sets
// MSG_CMSG_CLOEXEC). Recv must not be called concurrently.
func (c *Conn) Recv() (Record, error) {
	n, oobn, flags, _, err := c.c.ReadMsgUnix(c.buf, c.oob)
	if err != nil {
		return nil, err
	}
	fds, perr := parseRights(c.oob[:oobn])
	if perr != nil {
		closeAll(fds)
		return nil, perr
	}
	if n == 0 && len(fds) == 0 {
		return nil, io.EOF
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeAll(fds)
		return nil, protoErr("record or its descriptors were truncated")
	}
	r, err := Decode(c.buf[:n], len(fds))
	if err != nil {
		closeAll(fds)
		return nil, err
	}
	switch p := r.(type) {
	case Pages:
		p.FDs = fds
		return p, nil
	case Adopt, AllocateReq, FreeReq, CloseReq, AnswerReq, DroppedReq, UseReq:
		closeAll(fds)
		return nil, protoErr("%T record from the daemon (only clients send it)", r)
	}
	return r, nil
}

// Send writes one record with its descriptors (at most MaxFDs), blocking
// until deadline at most (zero: no deadline). The caller keeps the fds.
func (c *Conn) Send(r Record, fds []int, deadline time.Time) error {
	return c.send(context.Background(), r, fds, deadline)
}

// SendContext writes one record (no descriptors), blocking until ctx ends
// at most; then it returns ctx's error and nothing was sent (a
// SOCK_SEQPACKET record goes whole or not at all).
func (c *Conn) SendContext(ctx context.Context, r Record) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	deadline, _ := ctx.Deadline()
	err := c.send(ctx, r, nil, deadline)
	if err != nil && ctx.Err() != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		return ctx.Err()
	}
	return err
}

func (c *Conn) send(ctx context.Context, r Record, fds []int, deadline time.Time) error {
	if len(fds) > MaxFDs {
		return fmt.Errorf("fdchan: %d fds in one record, at most %d", len(fds), MaxFDs)
	}
	if f, ok := r.(FreeReq); ok && (len(f.PageIDs) == 0 || len(f.PageIDs) > MaxFreeIDs) {
		return fmt.Errorf("fdchan: a FREE record carries 1..%d page ids, not %d", MaxFreeIDs, len(f.PageIDs))
	}
	if d, ok := r.(DroppedReq); ok && (len(d.PageIDs) == 0 || len(d.PageIDs) > MaxFreeIDs) {
		return fmt.Errorf("fdchan: a DROPPED record carries 1..%d page ids, not %d", MaxFreeIDs, len(d.PageIDs))
	}
	if u, ok := r.(UseReq); ok && (len(u.PageIDs) == 0 || len(u.PageIDs) > MaxFreeIDs) {
		return fmt.Errorf("fdchan: a USE record carries 1..%d page ids, not %d", MaxFreeIDs, len(u.PageIDs))
	}
	if a, ok := r.(AnswerReq); ok && len(a.Reason) > MaxReason {
		return fmt.Errorf("fdchan: an ANSWER's reason is at most %d bytes, not %d", MaxReason, len(a.Reason))
	}
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if err := c.c.SetWriteDeadline(deadline); err != nil {
		return err
	}
	if ctx.Done() != nil {
		// A cancellation (not only a deadline) interrupts a blocked send.
		// The deadline it sets must not outlive this send: wait for it.
		fired := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			defer close(fired)
			_ = c.c.SetWriteDeadline(time.Unix(1, 0))
		})
		defer func() {
			if !stop() {
				<-fired
			}
		}()
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	data := Encode(r)
	n, _, err := c.c.WriteMsgUnix(data, oob, nil)
	if err == nil && n != len(data) {
		err = fmt.Errorf("fdchan: short send of a record: %d of %d bytes", n, len(data))
	}
	return err
}

// SendAdopt sends the pages of session as ADOPT records, MaxFDs per
// record (docs/protocol.md): ids[i] is the page whose descriptor is fds[i].
func (c *Conn) SendAdopt(session uint64, ids []uint64, fds []int, deadline time.Time) error {
	if len(ids) != len(fds) {
		return fmt.Errorf("fdchan: %d page ids and %d fds", len(ids), len(fds))
	}
	for i := 0; i < len(ids); i += MaxFDs {
		j := min(i+MaxFDs, len(ids))
		r := Adopt{SessionID: session, FirstIndex: uint32(i), Total: uint32(len(ids)), PageIDs: ids[i:j]}
		if err := c.Send(r, fds[i:j], deadline); err != nil {
			return err
		}
	}
	return nil
}

// Close closes the channel; a Recv blocked in another goroutine returns.
func (c *Conn) Close() error { return c.c.Close() }

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, protoErr("control message: %v", err)
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level == unix.SOL_SOCKET && msgs[i].Header.Type == unix.SCM_RIGHTS {
			got, err := unix.ParseUnixRights(&msgs[i])
			if err != nil {
				closeAll(fds)
				return nil, protoErr("SCM_RIGHTS: %v", err)
			}
			fds = append(fds, got...)
		}
	}
	return fds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// CloseFDs closes descriptors the caller owns.
func CloseFDs(fds []int) { closeAll(fds) }

// IsClosed reports whether err means the channel was closed locally.
func IsClosed(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrClosed) || errors.Is(err, syscall.ECONNRESET)
}
