package kvcached

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
)

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
		!strings.HasPrefix(err.(*Error).Message, "fd channel protocol error: ") {
		t.Errorf("NewError(ErrProtocol): %v", err)
	}
	if err := NewError(errors.New("not a sentinel"), "x", "y"); !errors.Is(err, ErrUnknown) {
		t.Errorf("NewError(not a sentinel) must be ErrUnknown: %v", err)
	}
}
