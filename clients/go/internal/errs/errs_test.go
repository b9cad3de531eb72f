package errs

import (
	"context"
	"errors"
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
		err := FromStatus("Op", status.Error(c, "what was wrong"))
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
		if back := ToCode(err); back != c {
			t.Errorf("%v -> %v -> %v", c, e.kind, back)
		}
		if back := ToCode(e.kind); back != c {
			t.Errorf("sentinel %v -> %v, want %v", e.kind, back, c)
		}
	}
	if len(seen) != len(codeTable) {
		t.Errorf("table has %d rows, %d codes tested", len(codeTable), len(seen))
	}
}

func TestStatusEdgeCases(t *testing.T) {
	if FromStatus("x", nil) != nil {
		t.Error("nil must stay nil")
	}
	err := FromStatus("x", status.Error(codes.DeadlineExceeded, "late"))
	if !errors.Is(err, ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("deadline: %v", err)
	}
	if err := FromStatus("x", context.Canceled); !errors.Is(err, ErrCanceled) || !errors.Is(err, context.Canceled) {
		t.Errorf("canceled: %v", err)
	}
	if err := FromStatus("x", status.Error(codes.DataLoss, "?")); !errors.Is(err, ErrUnknown) {
		t.Errorf("unlisted code: %v", err)
	}
	if err := FromStatus("x", errors.New("plain")); !errors.Is(err, ErrUnknown) {
		t.Errorf("plain error: %v", err)
	}
	if err := New(ErrNotMapped, "Region.ReadAt", "offset %d", 5); !errors.Is(err, ErrNotMapped) || errors.Is(err, ErrInternal) {
		t.Errorf("New: %v", err)
	}
}

// Checked: a kind from outside keeps its sentinel when it is one, and is
// ErrUnknown when it is not.
func TestChecked(t *testing.T) {
	for _, row := range codeTable {
		if err := Checked(row.Err, "x", "y"); !errors.Is(err, row.Err) || ToCode(err) != row.Code {
			t.Errorf("Checked(%v): %v", row.Err, err)
		}
	}
	if err := Checked(errors.New("other"), "x", "y"); !errors.Is(err, ErrUnknown) {
		t.Errorf("Checked(not a sentinel): %v", err)
	}
}
