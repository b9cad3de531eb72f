package kvcached

import "github.com/kvcached/kvcached-service/clients/go/internal/errs"

// Sentinel errors. Every error this package returns matches one of them
// with errors.Is (two client-side conditions match a second one: a
// protocol error, ErrProtocol, is also ErrInternal, the status it has in
// docs/protocol.md; a session the daemon ended without a way back is
// ErrFailedPrecondition and also ErrClosed). The first group corresponds
// one to one to the gRPC status codes the daemon uses (docs/protocol.md,
// "Status codes"); the mapping is one table, in internal/errs, and nowhere
// else.
var (
	ErrInvalidArgument    = errs.ErrInvalidArgument
	ErrNotFound           = errs.ErrNotFound
	ErrPermissionDenied   = errs.ErrPermissionDenied
	ErrResourceExhausted  = errs.ErrResourceExhausted
	ErrFailedPrecondition = errs.ErrFailedPrecondition
	ErrUnavailable        = errs.ErrUnavailable
	ErrDeadlineExceeded   = errs.ErrDeadlineExceeded
	ErrCanceled           = errs.ErrCanceled
	ErrInternal           = errs.ErrInternal
	ErrUnknown            = errs.ErrUnknown

	// Client-side conditions that have no status code of their own.

	// ErrNoSocket: no socket path given (FromEnv with neither
	// OLLAMA_KVCACHED_SOCKET nor KVCACHED_SOCKET set) or no socket file.
	ErrNoSocket = errs.ErrNoSocket
	// ErrClosed: the Client, Session or Region was closed, or the daemon
	// ended the session (GOODBYE, ERROR or the fd channel closed).
	ErrClosed = errs.ErrClosed
	// ErrProtocol: the daemon broke docs/protocol.md on the fd channel.
	ErrProtocol = errs.ErrProtocol
	// ErrNotMapped: a Region read or write touched a page that is not mapped.
	ErrNotMapped = errs.ErrNotMapped
	// ErrMapping: mapping a page into this process failed (mmap, or the
	// CUDA driver); the message carries errno or the driver's error name.
	ErrMapping = errs.ErrMapping
	// ErrNoCUDA: the CUDA driver could not be loaded (KVCACHED_LIBCUDA,
	// default libcuda.so.1), or the daemon's device is not visible to it.
	ErrNoCUDA = errs.ErrNoCUDA
)

// Error is the concrete type of errors that came from the daemon (gRPC
// status or an ERROR record on the fd channel) or from a client-side
// condition. Match it with errors.Is against the sentinels; errors.As
// gives the code (Code), the operation (Op) and the daemon's message
// (Message).
type Error = errs.Error

// NewError makes an error of sentinel kind (one of the Err variables
// above) for a condition found on the client's side, with op and a message
// saying what was wrong: for packages built on this one (the ollama
// package), so that their errors match the same sentinels. A kind that is
// not one of the sentinels is ErrUnknown.
func NewError(kind error, op, format string, a ...any) error {
	return errs.Checked(kind, op, format, a...)
}

// The package's own shorthands for internal/errs.

func statusToError(op string, err error) error          { return errs.FromStatus(op, err) }
func newError(kind error, op, f string, a ...any) error { return errs.New(kind, op, f, a...) }
func errorsIsAny(err error, targets ...error) bool      { return errs.IsAny(err, targets...) }
