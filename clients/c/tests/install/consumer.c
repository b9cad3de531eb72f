/* Builds against an installed libkvcached (pkg-config or find_package). */
#include <stdio.h>
#include <string.h>

#include <kvcached.h>

int main(void)
{
    kvc_client *c = NULL;
    /* No daemon at this path: the library answers with a status, never aborts. */
    kvc_status st = kvc_client_create("/nonexistent/kvcached.sock", &c);
    printf("api %d, connect: %s\n", kvc_api_version(), kvc_status_to_string(st));
    return (kvc_api_version() == KVC_API_VERSION && st == KVC_ERR_UNAVAILABLE && !c) ? 0 : 1;
}
