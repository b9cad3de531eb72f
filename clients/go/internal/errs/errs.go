// Package errs is the Go client's error taxonomy: the sentinels, the one
// table between gRPC status codes and sentinels, and the concrete *Error.
// The kvcached package re-exports all of it (kvcached.ErrNotFound is
// errs.ErrNotFound, kvcached.Error is errs.Error); it lives here so that the
// internal packages under the session (chanmux) make the same errors.
package errs

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Sentinel errors. Every error this package returns matches one of them
// with errors.Is (two client-side conditions match a second one: a
// protocol error, ErrProtocol, is also ErrInternal, the status it has in
// docs/protocol.md; a session the daemon ended without a way back is
// ErrFailedPrecondition and also ErrClosed). The first group corresponds one to one to the gRPC
// status codes the daemon uses (docs/protocol.md, "Status codes"); the
// mapping lives in FromStatus / ToCode below and nowhere else.
var (
	ErrInvalidArgument    = errors.New("kvcached: invalid argument")
	ErrNotFound           = errors.New("kvcached: not found")
	ErrPermissionDenied   = errors.New("kvcached: permission denied")
	ErrResourceExhausted  = errors.New("kvcached: resource exhausted")
	ErrFailedPrecondition = errors.New("kvcached: failed precondition")
	ErrUnavailable        = errors.New("kvcached: unavailable")
	ErrDeadlineExceeded   = errors.New("kvcached: deadline exceeded")
	ErrCanceled           = errors.New("kvcached: canceled")
	ErrInternal           = errors.New("kvcached: internal error")
	ErrUnknown            = errors.New("kvcached: unknown error")

	// Client-side conditions that have no status code of their own.

	// ErrNoSocket: no socket path given (FromEnv with neither
	// OLLAMA_KVCACHED_SOCKET nor KVCACHED_SOCKET set) or no socket file.
	ErrNoSocket = errors.New("kvcached: no daemon socket")
	// ErrClosed: the Client, Session or Region was closed, or the daemon
	// ended the session (GOODBYE, ERROR or the fd channel closed).
	ErrClosed = errors.New("kvcached: closed")
	// ErrProtocol: the daemon broke docs/protocol.md on the fd channel.
	ErrProtocol = errors.New("kvcached: fd channel protocol error")
	// ErrNotMapped: a Region read or write touched a page that is not mapped.
	ErrNotMapped = errors.New("kvcached: range not mapped")
	// ErrMapping: mapping a page into this process failed (mmap, or the
	// CUDA driver); the message carries errno or the driver's error name.
	ErrMapping = errors.New("kvcached: mapping failed")
	// ErrNoCUDA: the CUDA driver could not be loaded (KVCACHED_LIBCUDA,
	// default libcuda.so.1), or the daemon's device is not visible to it.
	ErrNoCUDA = errors.New("kvcached: CUDA driver not available")
)

// Row is one row of the table: a gRPC code and its sentinel.
type Row struct {
	Code codes.Code
	Err  error
}

// codeTable is the one mapping between gRPC codes and sentinel errors.
var codeTable = []Row{
	{codes.InvalidArgument, ErrInvalidArgument},
	{codes.NotFound, ErrNotFound},
	{codes.PermissionDenied, ErrPermissionDenied},
	{codes.ResourceExhausted, ErrResourceExhausted},
	{codes.FailedPrecondition, ErrFailedPrecondition},
	{codes.Unavailable, ErrUnavailable},
	{codes.DeadlineExceeded, ErrDeadlineExceeded},
	{codes.Canceled, ErrCanceled},
	{codes.Internal, ErrInternal},
	{codes.Unknown, ErrUnknown},
}

// Error is the concrete type of errors that came from the daemon (gRPC
// status or an ERROR record on the fd channel). Match it with errors.Is
// against the sentinels; errors.As gives the code and the daemon's message.
type Error struct {
	Op      string     // the rpc or operation ("Allocate", "fd channel")
	Code    codes.Code // the gRPC status code
	Message string     // the daemon's message: what was wrong
	kind    error      // the sentinel
	also    error      // a second sentinel it matches, or nil
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s: %s", e.kind.Error(), e.Op, e.Message)
}

// Unwrap returns the sentinel.
func (e *Error) Unwrap() error { return e.kind }

// Is makes a DeadlineExceeded or Canceled error also match the context
// package's errors, as Go callers expect.
func (e *Error) Is(target error) bool {
	if e.also != nil && target == e.also {
		return true
	}
	switch e.Code {
	case codes.DeadlineExceeded:
		return target == context.DeadlineExceeded
	case codes.Canceled:
		return target == context.Canceled
	}
	return false
}

// Table returns a copy of the table (for tests that walk every code).
func Table() []Row { return append([]Row(nil), codeTable...) }

// FromStatus turns an error returned by a gRPC call (or a status code
// and message from the fd channel) into an *Error wrapping a sentinel. It is
// the only place where gRPC codes become errors.
func FromStatus(op string, err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		// Not a status: a context error from before the call started.
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			st = status.New(codes.DeadlineExceeded, err.Error())
		case errors.Is(err, context.Canceled):
			st = status.New(codes.Canceled, err.Error())
		default:
			st = status.New(codes.Unknown, err.Error())
		}
	}
	kind := ErrUnknown
	for _, row := range codeTable {
		if row.Code == st.Code() {
			kind = row.Err
			break
		}
	}
	return &Error{Op: op, Code: st.Code(), Message: st.Message(), kind: kind}
}

// ToCode is the inverse of FromStatus (for fakes and the round-trip
// test): the code an error of this package travels as.
func ToCode(err error) codes.Code {
	for _, row := range codeTable {
		if errors.Is(err, row.Err) {
			return row.Code
		}
	}
	return codes.Unknown
}

// ProtocolPrefix starts the message of every protocol error, as in the
// other clients ("fd channel protocol error: ...").
const ProtocolPrefix = "fd channel protocol error: "

// New makes an *Error for a client-side condition. A protocol error
// (ErrProtocol) travels as INTERNAL and matches ErrInternal too.
func New(kind error, op, format string, a ...any) error {
	msg := fmt.Sprintf(format, a...)
	if kind == ErrProtocol {
		if !strings.HasPrefix(msg, ProtocolPrefix) {
			msg = ProtocolPrefix + msg
		}
		return &Error{Op: op, Code: codes.Internal, Message: msg, kind: kind, also: ErrInternal}
	}
	return &Error{Op: op, Code: ToCode(kind), Message: msg, kind: kind}
}

// Checked is New for a kind given by code outside this module's internals
// (kvcached.NewError): a kind that is not one of the sentinels is
// ErrUnknown.
func Checked(kind error, op, format string, a ...any) error {
	known := kind == ErrNoSocket || kind == ErrClosed || kind == ErrProtocol || kind == ErrNotMapped ||
		kind == ErrMapping || kind == ErrNoCUDA
	for _, row := range codeTable {
		known = known || kind == row.Err
	}
	if !known {
		kind = ErrUnknown
	}
	return New(kind, op, format, a...)
}

// Ended is the end of a session the daemon ended and nothing can
// bring back (a hang-up without a resume token, an unasked GOODBYE):
// FAILED_PRECONDITION, as the daemon answers calls on a closed session,
// and ErrClosed too.
func Ended(op, format string, a ...any) error {
	return &Error{Op: op, Code: codes.FailedPrecondition, Message: fmt.Sprintf(format, a...), kind: ErrFailedPrecondition, also: ErrClosed}
}

// IsAny reports whether err matches any of the targets.
func IsAny(err error, targets ...error) bool {
	for _, t := range targets {
		if errors.Is(err, t) {
			return true
		}
	}
	return false
}
