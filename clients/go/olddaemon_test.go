package kvcached

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

type oldDaemon struct {
	pb.UnimplementedKVCachedServer
}

func (oldDaemon) GetInfo(context.Context, *pb.GetInfoRequest) (*pb.GetInfoResponse, error) {
	return &pb.GetInfoResponse{Version: "0.1-before-channel-requests", ApiVersion: 1, FdSocket: "/nonexistent.fd", FdProtocolVersion: 1,
		Devices: []*pb.DeviceInfo{{Uuid: "HOST-0", Kind: "host", PageSize: 4096}}}, nil
}

// The client makes page operations on the fd channel only: a daemon that
// does not offer them (GetInfo().fd_channel_requests false, daemons before
// the feature) is refused at OpenSession with a message saying why,
// before any channel is connected.
func TestDaemonWithoutChannelRequestsIsRefused(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "old.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterKVCachedServer(srv, oldDaemon{})
	go srv.Serve(l)
	defer srv.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.OpenSession(ctx, "s")
	var e *Error
	if !errors.Is(err, ErrFailedPrecondition) || !errors.As(err, &e) || !strings.Contains(e.Message, "fd_channel_requests is false") {
		t.Fatalf("OpenSession on a daemon without channel requests: %v", err)
	}
}
