package kvcached

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// The client semantics of docs/protocol.md ("Client semantics"), as the
// shared scenario files tests/scenarios/*.json: the daemon's side is played
// by tests/helpers/fakedaemon.py (a subprocess, the venv's Python), the
// client's side by this harness, with what each operation must return or
// fail with. tests/test_scenarios.py runs the same files for Python.

type scenario struct {
	Name          string       `json:"name"`
	ClientTimeout float64      `json:"client_timeout"`
	Client        []scenarioOp `json:"client"`
}

type scenarioOp struct {
	Op       string   `json:"op"`
	Name     string   `json:"name"`
	NumPages int      `json:"num_pages"`
	PageIDs  []uint64 `json:"page_ids"`
	Seconds  float64  `json:"seconds"`
	Expect   struct {
		Error           string   `json:"error"`
		MessageContains string   `json:"message_contains"`
		PageIDs         []uint64 `json:"page_ids"`
		Contents        bool     `json:"contents"`
		Value           *uint64  `json:"value"`
	} `json:"expect"`
}

// scenarioCodes: the status names the files use, and the sentinel each is.
var scenarioCodes = map[string]error{
	"INVALID_ARGUMENT": ErrInvalidArgument, "NOT_FOUND": ErrNotFound, "PERMISSION_DENIED": ErrPermissionDenied,
	"RESOURCE_EXHAUSTED": ErrResourceExhausted, "FAILED_PRECONDITION": ErrFailedPrecondition,
	"UNAVAILABLE": ErrUnavailable, "DEADLINE_EXCEEDED": ErrDeadlineExceeded, "CANCELED": ErrCanceled,
	"INTERNAL": ErrInternal, "UNKNOWN": ErrUnknown,
}

type scenarioRun struct {
	t       *testing.T
	sc      scenario
	sock    string
	stdin   io.WriteCloser
	client  *Client
	session *Session
	pages   []*Allocation
}

func (h *scenarioRun) timeout() time.Duration {
	if h.sc.ClientTimeout > 0 {
		return time.Duration(h.sc.ClientTimeout * float64(time.Second))
	}
	return 5 * time.Second
}

// check says what is wrong with err for op's expectation ("" if nothing).
func (h *scenarioRun) check(op scenarioOp, err error) (expectedError bool, problem string) {
	want := op.Expect.Error
	if want == "" {
		if err != nil {
			return false, fmt.Sprintf("unexpected error: %v", err)
		}
		return false, ""
	}
	sentinel, ok := scenarioCodes[want]
	if !ok {
		return true, fmt.Sprintf("the scenario names an unknown status %q", want)
	}
	var e *Error
	switch {
	case err == nil:
		return true, fmt.Sprintf("succeeded; want %s", want)
	case !errors.Is(err, sentinel):
		return true, fmt.Sprintf("failed with %v; want %s", err, want)
	case !errors.As(err, &e):
		return true, fmt.Sprintf("%v is not a *kvcached.Error", err)
	case !strings.Contains(e.Message, op.Expect.MessageContains):
		return true, fmt.Sprintf("message %q does not contain %q", e.Message, op.Expect.MessageContains)
	}
	return true, ""
}

func (h *scenarioRun) run(i int, op scenarioOp) {
	t := h.t
	fail := func(format string, a ...any) {
		t.Helper()
		t.Fatalf("client op %d %+v: %s", i, op, fmt.Sprintf(format, a...))
	}
	ctx, cancel := context.WithTimeout(context.Background(), h.timeout())
	defer cancel()
	switch op.Op {
	case "open_session":
		// The file's client_timeout is for the calls it times (an Allocate
		// that gives up); connecting gets a generous bound of its own, for a
		// loaded 2-core machine.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := Dial(ctx, h.sock)
		if err != nil {
			fail("Dial: %v", err)
		}
		h.client = c
		s, err := c.OpenSession(ctx, op.Name)
		if _, problem := h.check(op, err); problem != "" {
			fail("%s", problem)
		}
		h.session = s
	case "allocate":
		a, err := h.session.Allocate(ctx, op.NumPages)
		isErr, problem := h.check(op, err)
		if problem != "" {
			fail("%s", problem)
		}
		if isErr {
			return
		}
		h.pages = append(h.pages, a)
		if op.Expect.PageIDs != nil && fmt.Sprint(a.IDs()) != fmt.Sprint(op.Expect.PageIDs) {
			fail("page ids %v", a.IDs())
		}
		if op.Expect.Contents {
			for _, p := range a.Pages {
				want := fmt.Sprintf("kvc-fake page %d", p.ID)
				buf := make([]byte, len(want))
				if _, err := p.File.ReadAt(buf, 0); err != nil || string(buf) != want {
					fail("the descriptor of page %d holds %q (%v)", p.ID, buf, err)
				}
			}
		}
	case "free":
		r, err := h.session.Free(ctx, op.PageIDs)
		isErr, problem := h.check(op, err)
		if problem != "" {
			fail("%s", problem)
		}
		if !isErr && op.Expect.Value != nil && r.PagesFreed != *op.Expect.Value {
			fail("freed %d pages", r.PagesFreed)
		}
	case "wait_resuming":
		deadline := time.Now().Add(10 * time.Second)
		for !h.session.m.Resuming() {
			if time.Now().After(deadline) {
				fail("the client did not notice the hang-up within 10 s")
			}
			time.Sleep(10 * time.Millisecond)
		}
	case "wait_resumed":
		wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer wcancel()
		if err := h.session.WaitResumed(wctx); err != nil {
			fail("not resumed: %v", err)
		}
	case "wait_ended":
		select {
		case <-h.session.Done():
		case <-time.After(10 * time.Second):
			fail("the client did not see the channel end within 10 s")
		}
	case "signal":
		if _, err := fmt.Fprintf(h.stdin, "signal %s\n", op.Name); err != nil {
			fail("%v", err)
		}
	case "sleep":
		time.Sleep(time.Duration(op.Seconds * float64(time.Second)))
	case "close":
		h.close()
	default:
		fail("unknown client op")
	}
}

func (h *scenarioRun) close() {
	for _, a := range h.pages {
		a.Close()
	}
	h.pages = nil
	if h.session != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = h.session.Close(ctx)
		cancel()
		h.session = nil
	}
	if h.client != nil {
		_ = h.client.Close()
		h.client = nil
	}
}

func TestScenarios(t *testing.T) {
	python := filepath.Join(repoRoot, ".venv", "bin", "python")
	if _, err := os.Stat(python); err != nil {
		t.Fatalf("%s: %v (scripts/setup.sh creates the venv)", python, err)
	}
	files, err := filepath.Glob(filepath.Join(repoRoot, "tests", "scenarios", "*.json"))
	if err != nil || len(files) < 10 {
		t.Fatalf("tests/scenarios: %d files, %v", len(files), err)
	}
	slots := make(chan struct{}, 4) // at most 4 fakes (Python + grpc) at once
	for _, file := range files {
		name := strings.TrimSuffix(filepath.Base(file), ".json")
		t.Run(name, func(t *testing.T) {
			t.Parallel() // each scenario is mostly waiting on its fake
			slots <- struct{}{}
			defer func() { <-slots }()
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			var sc scenario
			if err := json.Unmarshal(data, &sc); err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			sock := filepath.Join(t.TempDir(), "fake.sock")
			cmd := exec.Command(python, filepath.Join(repoRoot, "tests", "helpers", "fakedaemon.py"), "--socket", sock, "--scenario", file)
			cmd.Env = append(os.Environ(), "PYTHONPATH="+repoRoot)
			var stderr testdaemon.LockedBuffer
			cmd.Stderr = &stderr
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := false
			defer func() {
				if !exited {
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
				}
			}()
			lines := bufio.NewScanner(stdout)
			lines.Buffer(make([]byte, 1<<20), 1<<20)
			var ready struct {
				Ready bool `json:"ready"`
			}
			// Generous: the fake imports grpc on a busy 2-core machine.
			readyc := make(chan bool, 1)
			go func() { readyc <- lines.Scan() && json.Unmarshal(lines.Bytes(), &ready) == nil && ready.Ready }()
			select {
			case ok := <-readyc:
				if !ok {
					t.Fatalf("the fake daemon did not start: %s", stderr.String())
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("the fake daemon was not ready within 60 s: %s", stderr.String())
			}
			h := &scenarioRun{t: t, sc: sc, sock: sock, stdin: stdin}
			func() {
				defer h.close()
				for i, op := range sc.Client {
					h.run(i, op)
				}
			}()
			stdin.Close()
			// The script's last line says whether the client did what it expected.
			var last string
			done := make(chan struct{})
			go func() {
				for lines.Scan() {
					last = lines.Text()
				}
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(60 * time.Second):
				t.Fatalf("the fake daemon's script did not end within 60 s: %s", stderr.String())
			}
			err = cmd.Wait()
			exited = true
			var result struct {
				OK    bool   `json:"ok"`
				Step  int    `json:"step"`
				Error string `json:"error"`
			}
			if json.Unmarshal([]byte(last), &result) != nil || !result.OK || err != nil {
				t.Fatalf("the fake daemon's script failed: %s (exit: %v)\n%s", last, err, tail(stderr.String(), 3000))
			}
		})
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
