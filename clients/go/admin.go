package kvcached

import (
	"context"
	"time"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// The control-plane rpcs of a session beyond its own pages: the daemon's
// books (GetStats), asking a session to shrink (RequestShrink: same uid or
// admin) and changing its limits (SetSessionLimits: admin). They are gRPC
// calls with the session's reference; page operations go on the fd
// channel (internal/chanmux). Ollama's use of them is in the ollama package.

// Stats returns global and device numbers plus this session's (every
// session's for an admin session).
func (s *Session) Stats(ctx context.Context) (*Stats, error) {
	ref, gen, err := s.m.Call("GetStats")
	if err != nil {
		return nil, err
	}
	r, err := s.c.rpc.GetStats(ctx, &pb.GetStatsRequest{Session: ref})
	if err != nil {
		return nil, s.m.RPCErr("GetStats", gen, err)
	}
	return statsFromPB(r), nil
}

// Own returns this session's line of the daemon's books.
func (s *Session) Own(ctx context.Context) (SessionStats, error) {
	st, err := s.Stats(ctx)
	if err != nil {
		return SessionStats{}, err
	}
	for _, ss := range st.Sessions {
		if ss.ID == s.ID() {
			return ss, nil
		}
	}
	return SessionStats{}, newError(ErrNotFound, "GetStats", "session %d is not in the daemon's stats", s.ID())
}

// RequestShrink asks session id to shrink to targetBytes (never below its
// guarantee) within timeout (0 = the daemon's default), through its Watch
// stream. Allowed for a session of the same uid as the target, and for an
// admin session. It returns
// the pages asked for (0 if already small enough). The pages come back
// when the runner frees them; poll RunnerUsage to see it happen, or use
// Shrink with ShrinkWait to wait for the outcome.
func (s *Session) RequestShrink(ctx context.Context, id, targetBytes uint64, timeout time.Duration, opts ...ShrinkOption) (uint64, error) {
	r, err := s.Shrink(ctx, id, targetBytes, timeout, opts...)
	return r.PagesRequested, err
}

// ShrinkOption configures Shrink and RequestShrink.
type ShrinkOption func(*pb.RequestShrinkRequest)

// ShrinkWait makes the call wait (up to its timeout) until every reclaim
// request it sent is settled: answered (Session.AnswerReclaim), met by
// Frees, expired, or the session ended. The call returns before the
// caller's own ctx deadline in any case, with the requests as they stand.
func ShrinkWait() ShrinkOption { return func(r *pb.RequestShrinkRequest) { r.Wait = true } }

// ReclaimState is where a reclaim request stands.
type ReclaimState int

// Reclaim states, as kvcached.v1.ReclaimOutcome.State.
const (
	ReclaimUnknown  ReclaimState = iota
	ReclaimOpen                  // not settled yet
	ReclaimMet                   // the session holds no more than it was asked to keep
	ReclaimAnswered              // the session answered (BytesGiven, BytesKept, Reason)
	ReclaimExpired               // the deadline passed without the pages or an answer
	ReclaimEnded                 // the session ended
)

func (r ReclaimState) String() string {
	switch r {
	case ReclaimOpen:
		return "open"
	case ReclaimMet:
		return "met"
	case ReclaimAnswered:
		return "answered"
	case ReclaimExpired:
		return "expired"
	case ReclaimEnded:
		return "ended"
	}
	return "unknown"
}

// ReclaimOutcome is one reclaim request a shrink sent (one per device the
// session holds more on), as it stands when the call returns.
type ReclaimOutcome struct {
	ReclaimID      uint64 // Reclaim.ID of the event the session got
	Device         string
	PagesRequested uint64
	State          ReclaimState
	// The session's answer (Answered is true when it sent one, whatever
	// the state).
	Answered   bool
	BytesGiven uint64
	BytesKept  uint64
	Reason     string
	// The daemon's own books: bytes the session holds on the device now.
	HeldBytes uint64
}

// ShrinkOutcome is the answer to Shrink.
type ShrinkOutcome struct {
	PagesRequested uint64
	Reclaims       []ReclaimOutcome
}

// Shrink is RequestShrink with the outcome of every reclaim request it
// sent; with ShrinkWait it waits until they are settled.
func (s *Session) Shrink(ctx context.Context, id, targetBytes uint64, timeout time.Duration, opts ...ShrinkOption) (ShrinkOutcome, error) {
	ref, gen, err := s.m.Call("RequestShrink")
	if err != nil {
		return ShrinkOutcome{}, err
	}
	req := &pb.RequestShrinkRequest{Admin: ref, SessionId: id, TargetBytes: targetBytes,
		TimeoutMs: uint32(timeout / time.Millisecond)}
	for _, opt := range opts {
		opt(req)
	}
	r, err := s.c.rpc.RequestShrink(ctx, req)
	if err != nil {
		return ShrinkOutcome{}, s.m.RPCErr("RequestShrink", gen, err)
	}
	out := ShrinkOutcome{PagesRequested: r.GetPagesRequested()}
	for _, o := range r.GetReclaims() {
		st := ReclaimState(o.GetState())
		if st < ReclaimUnknown || st > ReclaimEnded {
			st = ReclaimUnknown
		}
		out.Reclaims = append(out.Reclaims, ReclaimOutcome{ReclaimID: o.GetReclaimId(), Device: o.GetDevice(),
			PagesRequested: o.GetPagesRequested(), State: st, Answered: o.GetAnswered(), BytesGiven: o.GetBytesGiven(),
			BytesKept: o.GetBytesKept(), Reason: o.GetReason(), HeldBytes: o.GetHeldBytes()})
	}
	return out, nil
}

// Limits are a session's reclaim limits; nil fields stay as they are.
type Limits struct {
	GuaranteedBytes *uint64
	MaxBytes        *uint64
	Priority        *int32
}

// SetLimits (admin) changes another session's limits.
func (s *Session) SetLimits(ctx context.Context, id uint64, l Limits) (SessionStats, error) {
	ref, gen, err := s.m.Call("SetSessionLimits")
	if err != nil {
		return SessionStats{}, err
	}
	req := &pb.SetSessionLimitsRequest{Admin: ref, SessionId: id}
	if l.GuaranteedBytes != nil {
		req.GuaranteedBytes = *l.GuaranteedBytes
		req.SetFields = append(req.SetFields, "guaranteed_bytes")
	}
	if l.MaxBytes != nil {
		req.MaxBytes = *l.MaxBytes
		req.SetFields = append(req.SetFields, "max_bytes")
	}
	if l.Priority != nil {
		req.Priority = *l.Priority
		req.SetFields = append(req.SetFields, "priority")
	}
	r, err := s.c.rpc.SetSessionLimits(ctx, req)
	if err != nil {
		return SessionStats{}, s.m.RPCErr("SetSessionLimits", gen, err)
	}
	return sessionStatsFromPB(r.GetSession()), nil
}
