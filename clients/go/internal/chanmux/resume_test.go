package chanmux

import (
	"context"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
	"github.com/kvcached/kvcached-service/clients/go/internal/testdaemon"
)

// fakeRestart is the fd socket of a restarted daemon: each connection is
// sent a HELLO, and what the client sends on it is read and dropped.
func fakeRestart(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fd.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if _, err := c.Write(fdchan.Encode(fdchan.Hello{ChannelID: 1, MaxFDs: fdchan.MaxFDs})); err != nil {
					return
				}
				buf := make([]byte, 1<<16)
				oob := make([]byte, unix.CmsgSpace(4*fdchan.MaxFDs))
				for {
					_, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
					if err != nil {
						return
					}
					if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
						for _, m := range msgs {
							if fds, err := unix.ParseUnixRights(&m); err == nil {
								fdchan.CloseFDs(fds)
							}
						}
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return path
}

// A resumable session's Free whose send fails because the daemon died
// (EPIPE) before the reader goroutine has seen the hang-up is a Free while
// the daemon is away: it succeeds, and the resume does not claim its pages
// (which frees them). The Python client had this race (a plain UNAVAILABLE
// after the Region had unmapped the pages, which stayed claimed).
func TestFreeWhoseSendFindsTheDaemonGone(t *testing.T) {
	claimed := make(chan []uint64, 1)
	s, fc := newFakeChannelMuxConfig(t, Config{
		ID: 7, Log: slog.New(slog.DiscardHandler), FDSocket: fakeRestart(t),
		ResumeToken: []byte("token"), ResumeTimeout: 10 * time.Second,
		Resume: func(_ context.Context, _ []byte, ids []uint64) (*pb.ResumeSessionResponse, error) {
			claimed <- slices.Clone(ids)
			return &pb.ResumeSessionResponse{Session: &pb.SessionRef{Id: 7}, PagesAdopted: uint64(len(ids))}, nil
		},
	})
	defer s.MarkClosed()
	ctx := testdaemon.Ctx(t)

	got := make(chan *Allocation, 1)
	go func() {
		a, err := s.Allocate(ctx, fdchan.AllocateReq{NumPages: 3})
		if err != nil {
			t.Error(err)
		}
		got <- a
	}()
	req := fc.next().(fdchan.AllocateReq)
	fc.sendPages(req.ReqID, []uint64{40, 41, 42})
	fc.send(fdchan.Reply{ReqID: req.ReqID, Value: 3 * 4096})
	a := <-got
	if a == nil {
		t.FailNow()
	}
	fdchan.CloseFDs(a.FDs)
	if s.Kept() != 3 {
		t.Fatalf("kept %d descriptors, want 3", s.Kept())
	}

	// The daemon's end stops reading: the client's sends fail with EPIPE,
	// while its reader sees no end of stream yet.
	if err := unix.Shutdown(fc.fd, unix.SHUT_RD); err != nil {
		t.Fatal(err)
	}
	n, err := s.Free(ctx, []uint64{40, 41})
	if err != nil || n != 2 {
		t.Fatalf("Free whose send failed (EPIPE): %d, %v; want 2, nil (deferred)", n, err)
	}
	if s.Resuming() {
		t.Fatal("the reader saw a hang-up: the test did not make the race it is about")
	}
	if st := s.KeptState(); !strings.Contains(st, "deferred map[40:") || !strings.Contains(st, " 41:") {
		t.Fatalf("pages 40 and 41 are not deferred: %s", st)
	}

	// The daemon is gone: the resume claims only the page still held.
	unix.Shutdown(fc.fd, unix.SHUT_RDWR)
	select {
	case ids := <-claimed:
		if !slices.Equal(ids, []uint64{42}) {
			t.Fatalf("the resume claimed %v, want [42]", ids)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no resume within 10 s")
	}
	if err := s.WaitResumed(ctx); err != nil {
		t.Fatal(err)
	}
	if s.Resumes() != 1 || s.Kept() != 1 {
		t.Fatalf("after the resume: %d resumes, %d descriptors kept (%s); want 1, 1", s.Resumes(), s.Kept(), s.KeptState())
	}
}
