package kvcached

import (
	"context"
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Every status code the daemon uses maps to a sentinel and back.
func TestStatusRoundTrip(t *testing.T) {
	used := []codes.Code{codes.InvalidArgument, codes.NotFound, codes.PermissionDenied,
		codes.ResourceExhausted, codes.FailedPrecondition, codes.Unavailable,
		codes.DeadlineExceeded, codes.Canceled, codes.Internal, codes.Unknown}
	seen := map[error]bool{}
	for _, c := range used {
		err := statusToError("Op", status.Error(c, "what was wrong"))
		var e *Error
		if !errors.As(err, &e) || e.Code != c || e.Message != "what was wrong" || e.Op != "Op" {
			t.Fatalf("%v: got %#v", c, err)
		}
		if seen[e.kind] {
			t.Errorf("%v: sentinel %v used twice", c, e.kind)
		}
		seen[e.kind] = true
		if !errors.Is(err, e.kind) {
			t.Errorf("%v: errors.Is(err, %v) is false", c, e.kind)
		}
		if back := errorToCode(err); back != c {
			t.Errorf("%v -> %v -> %v", c, e.kind, back)
		}
		if back := errorToCode(e.kind); back != c {
			t.Errorf("sentinel %v -> %v, want %v", e.kind, back, c)
		}
	}
	if len(seen) != len(codeTable) {
		t.Errorf("table has %d rows, %d codes tested", len(codeTable), len(seen))
	}
}

func TestStatusEdgeCases(t *testing.T) {
	if statusToError("x", nil) != nil {
		t.Error("nil must stay nil")
	}
	err := statusToError("x", status.Error(codes.DeadlineExceeded, "late"))
	if !errors.Is(err, ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("deadline: %v", err)
	}
	if err := statusToError("x", context.Canceled); !errors.Is(err, ErrCanceled) || !errors.Is(err, context.Canceled) {
		t.Errorf("canceled: %v", err)
	}
	if err := statusToError("x", status.Error(codes.DataLoss, "?")); !errors.Is(err, ErrUnknown) {
		t.Errorf("unlisted code: %v", err)
	}
	if err := statusToError("x", errors.New("plain")); !errors.Is(err, ErrUnknown) {
		t.Errorf("plain error: %v", err)
	}
	if err := newError(ErrNotMapped, "Region.ReadAt", "offset %d", 5); !errors.Is(err, ErrNotMapped) || errors.Is(err, ErrInternal) {
		t.Errorf("newError: %v", err)
	}
}

// NewError: what packages built on this one (ollama) return matches the
// same sentinels and carries the code the sentinel travels as.
func TestNewError(t *testing.T) {
	err := NewError(ErrNotFound, "Ollama", "no device %q", "GPU-9")
	var e *Error
	if !errors.Is(err, ErrNotFound) || !errors.As(err, &e) || e.Code != codes.NotFound || e.Op != "Ollama" ||
		e.Message != `no device "GPU-9"` {
		t.Fatalf("NewError(ErrNotFound): %#v", err)
	}
	if err := NewError(ErrNoSocket, "Ollama", "none"); !errors.Is(err, ErrNoSocket) || errors.Is(err, ErrUnknown) {
		t.Errorf("NewError(ErrNoSocket): %v", err)
	}
	if err := NewError(ErrProtocol, "x", "bad"); !errors.Is(err, ErrProtocol) || !errors.Is(err, ErrInternal) ||
		!strings.HasPrefix(err.(*Error).Message, protocolPrefix) {
		t.Errorf("NewError(ErrProtocol): %v", err)
	}
	if err := NewError(errors.New("not a sentinel"), "x", "y"); !errors.Is(err, ErrUnknown) {
		t.Errorf("NewError(not a sentinel) must be ErrUnknown: %v", err)
	}
}
